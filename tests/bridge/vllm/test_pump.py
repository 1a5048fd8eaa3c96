"""The client's pump (bridge/vllm/client.py) against a scripted engine: when a request that needs
its workers' answer ends one step before another such request, both are collected in one rpc at
the next step (a gathered batch that vLLM's engine core split in two cost a second collect), a
finished request's output reaches its caller only after its answer is in, and a request never
waits more than one step, nor for a request that was aborted."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from bridge.vllm import client
from bridge.vllm.client import VllmBackend, _Request
from interp_engine import Address
from interp_engine._plan import Plan


class _Engine:
    """Scripted steps: each step finishes the requests listed for it; every live request gets a token."""

    def __init__(self, finishes: list[set[str]]):
        self.finishes, self.live, self.rpcs = list(finishes), set(), []
        self.added: list[tuple[str, int]] = []  # (request id, the thread that added it)
        self.llm_engine = self

    def add_request(self, rid, prompt, params) -> None:
        self.added.append((rid, threading.get_ident()))
        self.live.add(rid)

    def add(self, *ids: str) -> None:
        self.live |= set(ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self):
        done = self.finishes.pop(0) if self.finishes else set()
        outs = [SimpleNamespace(request_id=i, finished=i in done, outputs=[SimpleNamespace(token_ids=[7])])
                for i in sorted(self.live)]
        self.live -= done
        return outs

    def abort_request(self, ids) -> None:
        self.live -= set(ids)

    def collective_rpc(self, method, args=()):
        self.rpcs.append((method, [rid for rid, _ in args[0]] if method == "interp_collect_many" else args))
        if method == "interp_collect_many":
            return [[{"found": True} for _ in args[0]]]
        return [None]


def _backend(engine: _Engine) -> VllmBackend:
    backend = VllmBackend.__new__(VllmBackend)  # no engine of its own: the scripted one
    backend._llm, backend._board, backend._spill, backend._dead = engine, None, None, False
    backend._in_process, backend.world = False, 1  # a multiprocess engine's driver
    backend._lock, backend._wake = threading.RLock(), threading.Condition()
    backend._requests, backend._held, backend._incoming, backend._queued = {}, [], [], []
    backend._ensure_driver = lambda: None  # the tests step it themselves
    return backend


def _request(backend: VllmBackend, name: str, max_tokens: int, seen: list) -> _Request:
    plan = Plan(reads=(Address("resid_post", 0),))
    request = _Request(name, name, plan, 3, None, lambda out: seen.append((name, out.finished)),
                       max_tokens=max_tokens)
    backend._requests[name] = request
    return request


def test_a_request_ending_a_step_before_another_is_collected_with_it():
    engine = _Engine([set(), {"a"}, {"b"}])
    backend, seen = _backend(engine), []
    a, b = _request(backend, "a", 2, seen), _request(backend, "b", 3, seen)
    engine.add("a", "b")
    backend._pump()
    backend._pump()  # a ends; b ends at the next step: a waits for it
    assert engine.rpcs == [] and ("a", True) not in seen and not a.released
    backend._pump()
    assert engine.rpcs == [("interp_collect_many", ["a", "b"])]
    assert seen[-2:] == [("a", True), ("b", True)] and a.settled == b.settled == [{"found": True}]
    assert not backend._held


def test_a_request_waits_one_step_at_most_and_never_for_an_aborted_one():
    # b "ends next step" by its token count, but the engine keeps it one step longer
    engine = _Engine([set(), {"a"}, set(), {"b"}])
    backend, seen = _backend(engine), []
    a, b = _request(backend, "a", 2, seen), _request(backend, "b", 3, seen)
    engine.add("a", "b")
    backend._pump()
    backend._pump()
    backend._pump()
    assert engine.rpcs == [("interp_collect_many", ["a"])] and ("a", True) in seen
    backend._pump()
    assert engine.rpcs[-1] == ("interp_collect_many", ["b"])

    engine = _Engine([set(), {"a"}])
    backend, seen = _backend(engine), []
    a, b = _request(backend, "a", 2, seen), _request(backend, "b", 3, seen)
    engine.add("a", "b")
    backend._pump()
    backend._pump()
    assert a in [r for r, _ in backend._held]
    backend._abort(b)  # what a was waiting for is gone: a is collected at the next pump
    assert backend._pump() and ("a", True) in seen and a.settled == [{"found": True}]
    assert ("interp_collect_many", ["a"]) in engine.rpcs and not backend._held


class _Quiet(_Engine):
    """Requests that want only their whole result: steps hand nothing over until the one that
    finishes them; each step takes ``seconds``."""

    def __init__(self, n_steps: int, seconds: float):
        super().__init__([set()] * (n_steps - 1) + [None])
        self.seconds, self.steps = seconds, 0

    def step(self):
        time.sleep(self.seconds)
        self.steps += 1
        if self.finishes.pop(0) is not None:
            return []
        outs = [SimpleNamespace(request_id=i, finished=True, outputs=[SimpleNamespace(token_ids=[7] * 3)])
                for i in sorted(self.live)]
        self.live.clear()
        return outs


def test_an_in_process_engine_steps_on_between_its_loops_turns_but_not_for_long(monkeypatch):
    """In-process, a waiting coroutine steps on without a trip through its event loop after steps that
    hand nothing over, but gives the loop a turn once ``_PUMP_TURN`` has gone by (so new requests,
    cancels and other tasks wait no longer than that), and at once when a step hands something over."""
    monkeypatch.setattr(client, "_PUMP_TURN", 0.02)
    engine = _Quiet(200, 0.002)
    backend, seen = _backend(engine), []
    backend._in_process = True
    request = _Request("a", "a", Plan(), 3, None, lambda out: seen.append(out.finished), max_tokens=600)
    backend._requests["a"] = request
    engine.add("a")
    backend._pump_on()
    assert 2 < engine.steps < 50 and not seen  # stepped on, then gave the loop its turn
    while not seen:
        before = engine.steps
        backend._pump_on()
        assert engine.steps - before < 50
    assert engine.steps == 200 and seen == [True]  # the handing step ended its turn
    assert backend._pump_on() is None and engine.steps == 200  # nothing in flight: no step


def _queue(backend: VllmBackend, name: str, seen: list) -> _Request:
    request = _Request(name, name, Plan(), 3, None, seen.append, max_tokens=1)
    backend._queued.append((request, {"prompt_token_ids": [1, 2, 3]}, None))
    return request


def test_a_release_hands_requests_to_an_engine_between_steps_from_the_releasing_thread():
    """The engine core starts on a request while the driver thread is still waking (the
    wake-up is off the request's path): the thread releasing it adds it when no step runs."""
    engine = _Engine([{"a"}])
    backend, seen = _backend(engine), []
    _queue(backend, "a", seen)
    backend._release()
    assert engine.added == [("a", threading.get_ident())]
    assert not backend._incoming and "a" in backend._requests
    backend._pump()
    assert [out.finished for out in seen] == [True]


def test_a_release_during_a_step_leaves_its_requests_to_the_driver_without_waiting():
    """A caller never waits for a running step to hand its request over: the stepping thread
    holds the engine, so the request waits for the driver's next step, which adds it."""
    engine = _Engine([{"a"}])
    backend, seen = _backend(engine), []
    stepping, done = threading.Event(), threading.Event()

    def step():
        with backend._lock:  # the driver inside a step
            stepping.set()
            done.wait(10)

    holder = threading.Thread(target=step)
    holder.start()
    try:
        assert stepping.wait(10)
        _queue(backend, "a", seen)
        releaser = threading.Thread(target=backend._release)
        releaser.start()
        releaser.join(2)
        assert not releaser.is_alive(), "the release waited for the step"
        assert engine.added == [] and len(backend._incoming) == 1
    finally:
        done.set()
        holder.join()
    backend._pump()  # the driver's next step adds it first
    assert [rid for rid, _ in engine.added] == ["a"] and [out.finished for out in seen] == [True]


def test_requests_released_together_are_added_by_the_driver_in_one_go():
    """A gathered batch is not added from the releasing thread, one request at a time while the
    engine core may already be running the first (which splits the batch into two forwards):
    the driver adds them all before its step."""
    engine = _Engine([{"a", "b", "c"}])
    backend, seen = _backend(engine), []
    for name in "abc":
        _queue(backend, name, seen)
    backend._release()
    assert engine.added == [] and len(backend._incoming) == 3
    backend._pump()
    assert sorted(rid for rid, _ in engine.added) == ["a", "b", "c"]
    assert sorted(out.finished for out in seen) == [True] * 3
