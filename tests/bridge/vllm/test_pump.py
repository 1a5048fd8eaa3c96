"""The client's pump (bridge/vllm/client.py) against a scripted engine: when a request that needs
its workers' answer ends one step before another such request, both are collected in one rpc at
the next step (a gathered batch that vLLM's engine core split in two cost a second collect), a
finished request's output reaches its caller only after its answer is in, and a request never
waits more than one step, nor for a request that was aborted."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from bridge.vllm.client import VllmBackend, _Request
from interp_engine import Address
from interp_engine._plan import Plan


class _Engine:
    """Scripted steps: each step finishes the requests listed for it; every live request gets a token."""

    def __init__(self, finishes: list[set[str]]):
        self.finishes, self.live, self.rpcs = list(finishes), set(), []
        self.llm_engine = self

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
