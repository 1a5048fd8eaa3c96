"""The worker-resident runtime under faults: cancelled requests leave nothing behind, one bad
request never fails the others, an error inside the runtime fails only its request, and the
same runtime serves an in-process engine and a tensor-parallel one with the same numbers."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from interp_engine import (SteerSpec, capture_generation, generate_stream, load_model, run_with_cache, steer,
                           to_address)
from interp_engine.testing import assert_close_scaled, tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                  reason="vllm not installed")]
PROMPT = "Once upon a time, in a land far away, there lived"


@pytest.fixture(scope="module")
def pair(model_pool):
    return model_pool.get("qwen3"), model_pool.get("qwen3", "vllm", enable_prompt_embeds=True)


def _holds_nothing(model) -> None:
    """Nothing of any request is left: not in our client, not in vLLM, not in the workers."""
    backend = model.backend
    # a tiny request lets vLLM's worker see the aborts of the ones before it
    list(generate_stream(model, [5, 6], max_tokens=1, temperature=0.0))
    assert not backend._requests
    assert backend._engine().llm_engine.get_num_unfinished_requests() == 0
    for stats in backend.worker_stats():
        assert stats["live"] == 0 and stats["by_rid"] == 0 and stats["finished"] == 0, stats
        # vLLM's model runner forgets a finished request at its next step; an idle in-process
        # engine takes none after the tiny request, so that one may still be listed there
        assert stats["scheduled"] <= (1 if backend.in_process else 0), stats


def _spec(model, seed=0):
    v = torch.randn(model.d_model, generator=torch.Generator().manual_seed(seed))
    return SteerSpec.add("resid_post.1", v, scale=3.0)


def test_every_way_of_walking_away_cancels_the_request(pair):
    _, vllm = pair
    tokens = vllm.to_tokens(PROMPT)
    spec = _spec(vllm)
    # break out of the sync stream
    with steer(vllm, spec):
        for i, _ in enumerate(generate_stream(vllm, tokens, max_tokens=400, temperature=0.0, stop_at_eos=False)):
            if i == 2:
                break
    _holds_nothing(vllm)

    # an exception in the consumer (KeyboardInterrupt, as a SIGINT would raise, and any other)
    for error in (KeyboardInterrupt, ValueError):
        try:
            with steer(vllm, spec):
                for i, _ in enumerate(generate_stream(vllm, tokens, max_tokens=400, temperature=0.0,
                                                      stop_at_eos=False)):
                    if i == 2:
                        raise error("the consumer gave up")
        except error:
            pass
        _holds_nothing(vllm)

    async def aclose_midway():
        stream = vllm.generate_stream(tokens, max_tokens=400, temperature=0.0, stop_at_eos=False, steer=spec)
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(aclose_midway())
    _holds_nothing(vllm)

    async def cancel_task():
        task = asyncio.create_task(vllm.capture_generation(tokens, ["resid_post.0"], max_tokens=400,
                                                           temperature=0.0, stop_at_eos=False, steer=spec))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_task())
    _holds_nothing(vllm)


def test_rounds_of_concurrent_cancels_leave_no_orphans(pair):
    _, vllm = pair
    tokens = vllm.to_tokens(PROMPT)

    async def round_(k):
        tasks = [asyncio.create_task(vllm.generate_text(tokens, max_tokens=300, temperature=0.0, stop_at_eos=False,
                                                        steer=_spec(vllm, i) if i % 2 else None))
                 for i in range(16)]
        await asyncio.sleep(0.2 + 0.05 * k)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    for k in range(6):
        asyncio.run(round_(k))
        assert vllm.backend._engine().llm_engine.get_num_unfinished_requests() == 0
    _holds_nothing(vllm)


def test_one_bad_request_fails_alone(pair):
    eager, vllm = pair
    tokens = vllm.to_tokens(PROMPT)
    alone = [asyncio.run(vllm.generate_text(tokens, max_tokens=6, temperature=0.0, steer=s))
             for s in (None, _spec(vllm))]

    async def mixed():
        bad_calls = (lambda: vllm.generate_text(tokens, max_tokens=6, seed=2**64),
                     lambda: vllm.generate_text([5 + i % 400 for i in range(600)], max_tokens=6),
                     lambda: vllm.capture_generation(tokens, ["resid_post.9"], max_tokens=6))
        good = [vllm.generate_text(tokens, max_tokens=6, temperature=0.0, steer=s) for s in (None, _spec(vllm))]
        errors = []
        for call in bad_calls:  # refused when the call is built, before the engine sees anything
            try:
                call()
            except ValueError as exc:
                errors.append(str(exc))
        return errors, await asyncio.gather(*good)

    errors, results = asyncio.run(mixed())
    assert len(errors) == 3 and "2**64" in errors[0] and "context" in errors[1] and "layer 9" in errors[2]
    assert results == alone
    _holds_nothing(vllm)


def test_an_error_inside_the_runtime_fails_only_its_request(monkeypatch, model_pool):
    """An in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a fault can be planted in the
    worker's own code: one request's write raises; its client gets a clear error, the requests
    beside it in the same batch are untouched, and the engine keeps serving."""
    import bridge.vllm.runtime as runtime_module

    eager = model_pool.get("llama")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm = load_model(tiny_model("llama"), backend="vllm")
    vllm.warmup()
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    try:
        tokens = vllm.to_tokens(PROMPT)
        marker = torch.full((vllm.d_model,), 0.5)
        good = _spec(vllm, 3)
        real = runtime_module.apply_write

        def faulty(kind, x, vec, sel, base=None, **kwargs):
            if vec.numel() and float(vec.reshape(-1)[0]) == 0.5 * 2.0:  # the marked request only
                raise RuntimeError("planted fault in a write")
            return real(kind, x, vec, sel, base, **kwargs)

        monkeypatch.setattr(runtime_module, "apply_write", faulty)
        # at the prompt only: a write of its own (the adds at every position of several
        # requests at one site are done together, without apply_write)
        bad = SteerSpec.add("resid_post.1", marker, scale=2.0, positions="prompt")

        async def together():
            jobs = [vllm.generate_text(tokens, max_tokens=8, temperature=0.0, steer=s) for s in (bad, good, None)]
            return await asyncio.gather(*jobs, return_exceptions=True)

        forwards = vllm.backend.worker_stats()[0]["forwards"]
        failed, steered, plain = asyncio.run(together())
        # gathered requests enter the in-process engine's first step together too (its callers
        # step it: the first used to step it with its own request alone, then two, then three)
        stats = vllm.backend.worker_stats()[0]
        rows = stats["forward_rows"][len(stats["forward_rows"]) - (stats["forwards"] - forwards):]
        assert rows[:2] == [3 * tokens.shape[1], 3], rows
        assert isinstance(failed, RuntimeError) and "planted fault in a write" in str(failed)
        with steer(eager, good):
            expected = eager.to_string([s.token_id for s in generate_stream(eager, tokens, max_tokens=8,
                                                                            temperature=0.0)])
        assert steered == expected
        assert plain == eager.to_string([s.token_id for s in generate_stream(eager, tokens, max_tokens=8,
                                                                             temperature=0.0)])
        monkeypatch.setattr(runtime_module, "apply_write", real)
        # the in-process engine serves the same numbers as eager and as the multiprocess one
        points = ["resid_post.0", "z.1", "attn_out.2", "resid_mid.1"]
        ce, cv = run_with_cache(eager, tokens, points), run_with_cache(vllm, tokens, points)
        for p in points:
            assert_close_scaled(cv[p], ce[p], msg=p)
        # its worker answers the collect rpc with tensors (nothing is serialized in one process),
        # each in memory of its own: the next requests' rows, read into the buffers these
        # viewed, leave them as they were
        asked = []
        rpc = vllm.backend._llm.collective_rpc
        monkeypatch.setattr(vllm.backend._llm, "collective_rpc",
                            lambda method, *a, **k: (asked.append((method, k.get("args"))), rpc(method, *a, **k))[1])

        def capture(prompt, n):
            return vllm.capture_generation(prompt, points, max_tokens=n, temperature=0.0, stop_at_eos=False)

        async def run(first, then):
            # a long request keeps the buffers' arenas in use, so the regions the first
            # captures held are handed to the next ones
            long = asyncio.ensure_future(capture(tokens[0].tolist(), 24))
            kept = await asyncio.gather(*[capture(p, 3) for p in first])
            await asyncio.gather(*[capture(p, 3) for p in then])
            await long
            return kept

        first = [tokens[0, : 5 + i].tolist() for i in range(3)]
        kept = asyncio.run(run(first, [tokens[0, 2: 9 + i].tolist() for i in range(3)]))
        assert any(m == "interp_collect_many" and args[2:] == (True,) for m, args in asked)
        for prompt, (_, rows) in zip(first, kept):
            _, expected = capture_generation(eager, torch.tensor([prompt]), points, max_tokens=3, temperature=0.0,
                                             stop_at_eos=False)
            for p in points:
                assert_close_scaled(rows[to_address(p)], expected[p], msg=p)
        _holds_nothing(vllm)
    finally:
        vllm.close()


@pytest.mark.parametrize("arch", ["qwen3"])
def test_tensor_parallel_two_ranks_equal_one_and_eager(model_pool, arch, tmp_path, monkeypatch):
    """Two CPU ranks (VLLM_CPU_OMP_THREADS_BIND is set to one core each): points read after the
    all-reduce, z gathered from the ranks' head slices, steering applied on every rank."""
    eager = model_pool.get(arch)
    one = model_pool.get(arch, "vllm", enable_prompt_embeds=True)
    two = model_pool.get(arch, "vllm", tensor_parallel_size=2)
    two.warmup()
    assert two.backend.world == 2
    tokens = eager.to_tokens(PROMPT)
    points = [f"{n}.{layer}" for n in ("resid_post", "resid_mid", "attn_out", "mlp_out", "z") for layer in (0, 2)]
    ce, c1, c2 = (run_with_cache(m, tokens, points) for m in (eager, one, two))
    for p in points:
        assert_close_scaled(c2[p], ce[p], msg=f"tp2 vs eager {p}")
        assert_close_scaled(c2[p], c1[p], msg=f"tp2 vs tp1 {p}")
    spec = _spec(eager, 5) | SteerSpec.ablate("resid_mid.2", torch.randn(eager.d_model))
    runs = []
    for model in (eager, one, two):
        with steer(model, spec):
            runs.append(list(generate_stream(model, tokens, max_tokens=10, temperature=0.0, n_logprobs=2)))
    assert [s.token_id for s in runs[2]] == [s.token_id for s in runs[1]] == [s.token_id for s in runs[0]]
    for a, b in zip(runs[0], runs[2]):
        assert b.logprob == pytest.approx(a.logprob, abs=2e-5)
    completion, values = capture_generation(two, tokens, ["resid_post.1", "z.2"], max_tokens=5, temperature=0.0)
    _, expected = capture_generation(eager, tokens, ["resid_post.1", "z.2"], max_tokens=5, temperature=0.0)
    for p in ("resid_post.1", "z.2"):
        assert_close_scaled(values[p], expected[p], msg=f"tp2 generation {p}")
    from interp_engine import head_contributions

    assert_close_scaled(head_contributions(two, c2, 2), head_contributions(eager, ce, 2), msg="heads tp2")
    last = [f"resid_post.{eager.n_layers - 1}"]
    assert_close_scaled(two.decode_residuals(run_with_cache(two, tokens, last)),
                        eager.decode_residuals(run_with_cache(eager, tokens, last)), msg="lens tp2")
    # harvest: both ranks write resid_post into the shard's file; z's head slices come back by
    # rpc and are joined and written by the client (so this plan settles by rpc, not the board)
    from interp_engine import harvest

    texts = [f"Item {i}: the capital of France is Paris, and {i} plus one is {i + 1}." for i in range(8)]
    kwargs = dict(context_size=12, max_tokens=3, max_in_flight=4)
    harvest(eager, texts, ["resid_post.1", "z.2"], tmp_path / "eager", **kwargs)
    harvest(two, texts, ["resid_post.1", "z.2"], tmp_path / "tp2", **kwargs)
    a, b = harvest.load(tmp_path / "eager"), harvest.load(tmp_path / "tp2")
    assert torch.equal(a.token_ids, b.token_ids)
    for p in ("resid_post.1", "z.2"):
        assert_close_scaled(b[p], a[p], msg=f"tp2 harvest {p}")
    # points every rank holds whole: rank 0 writes them, both ranks say so on the status board,
    # and no window asks the workers anything
    rpcs = []
    collect = type(two.backend)._collect
    monkeypatch.setattr(type(two.backend), "_collect",
                        lambda self, llm, ended: rpcs.append(len(ended)) or collect(self, llm, ended))
    harvest(two, texts, ["resid_post.1", "mlp_out.2"], tmp_path / "tp2-board", **kwargs)
    harvest(eager, texts, ["resid_post.1", "mlp_out.2"], tmp_path / "eager-board", **kwargs)
    a, b = harvest.load(tmp_path / "eager-board"), harvest.load(tmp_path / "tp2-board")
    for p in ("resid_post.1", "mlp_out.2"):
        assert_close_scaled(b[p], a[p], msg=f"tp2 harvest {p}")
    assert rpcs == []
    _holds_nothing(two)


@pytest.mark.timeout(180)  # without the watchdog the request waits forever: a hang fails here
def test_a_dead_engine_core_fails_its_request_instead_of_hanging():
    """The engine core process dies while a request waits on it (a crash, the OOM killer): the
    caller gets a clear error within seconds, later calls say the engine is gone and what to do,
    and the model still closes. The core is stopped before the request and killed after it was
    sent, so the driver's step is surely waiting on the dead core's outputs."""
    import os
    import signal
    import threading
    import time

    import psutil

    def cores() -> set[int]:
        found = set()
        for child in psutil.Process().children(recursive=True):
            try:
                if "EngineCore" in child.name() + " ".join(child.cmdline()):
                    found.add(child.pid)
            except psutil.Error:
                pass
        return found

    before = cores()
    model = load_model(tiny_model("llama"), backend="vllm", kv_cache_memory_bytes=64 << 20)
    try:
        model.warmup()
        (core,) = cores() - before
        tokens = model.to_tokens(PROMPT)
        os.kill(core, signal.SIGSTOP)
        start = time.monotonic()
        threading.Timer(1.0, os.kill, (core, signal.SIGKILL)).start()
        with steer(model, _spec(model)), pytest.raises(RuntimeError, match="engine core died") as failed:
            list(generate_stream(model, tokens, max_tokens=8, temperature=0.0))
        assert time.monotonic() - start < 60
        assert "load the model again" in str(failed.value)
        with pytest.raises(RuntimeError, match="load the model again"):
            run_with_cache(model, tokens, ["resid_post.0"])
        assert not model.backend._requests
    finally:
        model.close()


def _count_handovers(backend, monkeypatch) -> list[int]:
    """A list that gets, at each hand-over of requests to the engine, how many were handed."""
    handed, admit = [], backend._admit

    def counting(llm):
        if backend._incoming:
            handed.append(len(backend._incoming))
        return admit(llm)
    monkeypatch.setattr(backend, "_admit", counting)
    return handed


def test_requests_gathered_together_are_handed_to_the_engine_together(pair, monkeypatch):
    """Concurrent requests from one event loop reach the engine in one hand-over, so they can
    share its first step (the driver used to take the first alone while the rest waited a
    step, which doubled a batch of short requests' time). A synchronous call made inside a
    running loop hands its request over at once (it blocks that loop)."""
    _, vllm = pair
    ids = vllm.to_tokens(PROMPT)[0].tolist()
    prompts = [ids[: 3 + i] for i in range(8)]
    handed = _count_handovers(vllm.backend, monkeypatch)

    async def go():
        await asyncio.gather(*[vllm.generate_full(p, max_tokens=1, temperature=0.0, stop_at_eos=False)
                               for p in prompts])

    for _ in range(3):
        handed.clear()
        asyncio.run(go())
        assert handed == [len(prompts)], handed

    async def synchronous_inside_a_loop():
        return run_with_cache(vllm, [ids], ["resid_post.0"])

    assert asyncio.run(synchronous_inside_a_loop())["resid_post.0"].shape[1] == len(ids)


def test_worker_computations_between_steps_neither_steer_nor_capture_for_a_request(pair):
    """head_contributions (and the lens) run vLLM's own o_proj (final norm, head) inside the
    workers, between engine steps, while the hooked sites still hold the last step's rows. A
    steered capture at the o_proj input is in flight meanwhile: each head_contributions must
    equal the one with nothing in flight, and the request's rows must equal eager's."""
    from interp_engine import head_contributions

    eager, vllm = pair
    tokens = vllm.to_tokens(PROMPT)
    cache = run_with_cache(vllm, tokens, ["z.1"])
    alone = head_contributions(vllm, cache, 1)
    v = torch.randn(vllm.graph.n_heads, vllm.graph.d_head, generator=torch.Generator().manual_seed(3))
    spec = SteerSpec.add("z.1", v, scale=4.0)

    async def both():
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(vllm.capture_generation(tokens, ["z.1"], max_tokens=24, temperature=0.0,
                                                           stop_at_eos=False, steer=spec))
        heads = []
        while not task.done():
            heads.append(await loop.run_in_executor(None, head_contributions, vllm, cache, 1))
        return await task, heads

    (completion, captured), heads = asyncio.run(both())
    assert len(heads) >= 2  # (several computations fell between the request's steps)
    for h in heads:
        torch.testing.assert_close(h, alone, rtol=0, atol=0)
    with steer(eager, spec):
        want_completion, want = capture_generation(eager, tokens, ["z.1"], max_tokens=24, temperature=0.0,
                                                   stop_at_eos=False)
    assert completion.token_ids == want_completion.token_ids
    assert_close_scaled(captured[to_address("z.1")], want[to_address("z.1")], msg="z.1 of the steered request")
