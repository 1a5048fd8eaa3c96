"""backend="vllm-static": taps and steering sites compiled into vLLM's graph (torch.compile on,
inductor on CPU). Captures and steered greedy tokens/logprobs equal the eager backend (fp32),
concurrent requests steer differently, undeclared work is refused before any forward, editing
vectors never recompiles, and the compile-cache key follows the declared set.

One engine per architecture for the module (each declared set is one compile: the first run on
a machine compiles, later runs load vLLM's AOT cache)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from interp_engine import (Address, CapabilityUnsupported, SteerSpec, capture_generation, generate_stream,
                           load_model, run_with_cache, steer)
from interp_engine.testing import assert_close_scaled, tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                  reason="vllm not installed")]

PROMPTS = ("The capital of France is", "Once upon a time, in a land far away, there lived a café owner")
NAMES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
N_LAYERS = 3  # the tiny models


def _declared() -> dict:
    every = tuple(f"{n}.{layer}" for layer in range(N_LAYERS) for n in NAMES)
    return {"static_points": every, "static_writes": every}


@pytest.fixture(scope="module")
def qwen3(model_pool):
    return model_pool.get("qwen3"), model_pool.get("qwen3", "vllm-static", **_declared())


def _specs(model):
    g = torch.Generator().manual_seed(3)
    d, last = model.d_model, model.n_layers - 1
    v, u = torch.randn(d, generator=g), torch.randn(d, generator=g)
    return {
        "add_resid_post": SteerSpec.add("resid_post.1", v, scale=3.0),
        "add_last_layer": SteerSpec.add(f"resid_post.{last}", v, scale=2.0),
        "ablate_mid_set_pre": SteerSpec.ablate("resid_mid.1", u) | SteerSpec.set("resid_pre.2", v * 2, positions=[3]),
        "attn_mlp_prompt_generated": SteerSpec.add("attn_out.0", v, scale=4.0, positions="prompt")
        | SteerSpec.add("mlp_out.2", u, scale=4.0, positions="generated"),
        "per_position_layer0": SteerSpec.add("resid_pre.0", torch.stack([v, u]) * 3, positions=[1, 4]),
        "ablate_resid_post": SteerSpec.ablate("resid_post.0", v),
    }


def _same_steps(se, sv, name=""):
    assert [s.token_id for s in sv] == [s.token_id for s in se], name
    for a, b in zip(se, sv):
        assert [d["token_id"] for d in b.logprobs] == [d["token_id"] for d in a.logprobs], name
        expected = torch.tensor([d["logprob"] for d in a.logprobs])
        got = torch.tensor([d["logprob"] for d in b.logprobs])
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5, msg=name)


def _info(model) -> dict:
    return model.backend.rpc("interp_static_info")[0]


def test_what_it_serves_is_known_before_warmup_and_undeclared_work_is_refused():
    model = load_model(tiny_model("qwen3"), backend="vllm-static",
                       static_points=["resid_post.1", "mlp_out.2"], static_writes=["resid_post.1"])
    assert model.static_points == (Address("resid_post", 1), Address("mlp_out", 2))
    assert model.static_writes == (Address("resid_post", 1),)
    assert model.hooks_available and not model.graph_replay
    tokens = model.to_tokens(PROMPTS[0])
    with pytest.raises(CapabilityUnsupported) as info:
        run_with_cache(model, tokens, ["resid_post.0"])
    assert "resid_post.1, mlp_out.2" in str(info.value) and "static_points=" in str(info.value)
    with pytest.raises(CapabilityUnsupported, match="static_point.*z.1"):  # cannot be declared at all
        run_with_cache(model, tokens, ["z.1"])
    with pytest.raises(CapabilityUnsupported) as info:
        with steer(model, SteerSpec.add("attn_out.0", torch.ones(model.d_model))):
            pass
    assert "static_writes" in str(info.value) and "resid_post.1" in str(info.value)
    # the async methods refuse when called, before their coroutine (or any forward) runs
    ids = tokens[0].tolist()
    with pytest.raises(CapabilityUnsupported, match="static_points="):
        model.capture_generation(ids, ["resid_post.1", "resid_post.0"], max_tokens=2)
    with pytest.raises(CapabilityUnsupported, match="static_writes"):
        model.capture_generation(ids, ["resid_post.1"], steer=SteerSpec.add("attn_out.0", torch.ones(model.d_model)))
    for method in (model.generate_text, model.generate_full, model.generate_stream):
        with pytest.raises(CapabilityUnsupported, match="static_writes"):
            method(ids, steer=SteerSpec.add("attn_out.0", torch.ones(model.d_model)))
    two = SteerSpec.add("resid_post.1", torch.ones(model.d_model)) | SteerSpec.ablate("resid_post.1",
                                                                                      torch.ones(model.d_model))
    with pytest.raises(CapabilityUnsupported, match="two steering ops at resid_post.1"):
        with steer(model, two):
            pass
    # bounded buffers: a function of max_num_batched_tokens, the declared points and d_model
    per_tap = (model.backend.engine_config().scheduler_config.max_num_batched_tokens + 1) * model.d_model * 4
    assert model.backend.static_buffer_bytes == 2 * per_tap + 1 * 65 * (2 * model.d_model + 2) * 4
    auto = load_model(tiny_model("qwen3"), backend="vllm-static")  # static_points="auto" by default
    assert {a.name for a in auto.static_points} == {"resid_post", "attn_out", "mlp_out"}
    assert auto.static_writes == tuple(Address("resid_post", i) for i in range(auto.n_layers))
    with pytest.raises(CapabilityUnsupported, match="static_point.*z.1"):
        load_model(tiny_model("qwen3"), backend="vllm-static", static_points=["z.1"])
    with pytest.raises(ValueError, match="enforce_eager"):
        load_model(tiny_model("qwen3"), backend="vllm-static", enforce_eager=True)
    assert model.backend._llm is None and auto.backend._llm is None  # nothing started


def test_compile_cache_key_follows_the_declared_set(qwen3):
    _, model = qwen3
    other = load_model(tiny_model("qwen3"), backend="vllm-static", static_points=["resid_post.1"])
    same = load_model(tiny_model("qwen3"), backend="vllm-static", **_declared())
    key = model.backend.engine_config().compute_hash()
    assert other.backend.engine_config().compute_hash() != key
    assert same.backend.engine_config().compute_hash() == key
    info = _info(model)  # the running worker compiled exactly the declared set
    assert info["points"] == [str(a) for a in model.static_points]
    assert info["writes"] == [str(a) for a in model.static_writes]


def test_declared_points_equal_eager(qwen3):
    eager, model = qwen3
    points = list(model.static_points)
    for prompt in PROMPTS:
        tokens = eager.to_tokens(prompt)
        ce, cs = run_with_cache(eager, tokens, points), run_with_cache(model, tokens, points)
        for address in points:
            assert_close_scaled(cs[address], ce[address], msg=str(address))
    counts = _info(model)["counts"]
    assert counts["dynamo_graph_breaks"] == 0, counts  # the ops are inside the compiled graph
    assert counts["vllm_aot_compiles"] + counts["vllm_aot_loaded"] + counts["dynamo_unique_graphs"] >= 1, counts


def test_capture_while_generating_equals_eager(qwen3, monkeypatch):
    from tests.bridge.vllm.test_board import _rpcs

    eager, model = qwen3
    tokens = eager.to_tokens(PROMPTS[0])
    points = ["resid_pre.0", "resid_mid.1", f"resid_post.{N_LAYERS - 1}", "attn_out.2", "mlp_out.0"]
    ce_completion, ce = capture_generation(eager, tokens, points, max_tokens=7, temperature=0.0)
    calls = _rpcs(model.backend, monkeypatch)
    cs_completion, cs = capture_generation(model, tokens, points, max_tokens=7, temperature=0.0)
    assert cs_completion.token_ids == ce_completion.token_ids
    # the compiled taps' rows were held in the worker and written into the client's inbox by the
    # forward of the last position (bridge/vllm/inbox.py): no collect rpc
    assert calls == [] and not model.backend.in_process
    for point in points:
        assert cs[point].shape[1] == tokens.shape[1] + 6
        assert_close_scaled(cs[point], ce[point], msg=point)


def test_steered_tokens_logprobs_and_captures_equal_eager(qwen3):
    eager, model = qwen3
    tokens = eager.to_tokens(PROMPTS[1])
    points = [Address(n, layer) for n in ("resid_mid", "resid_post", "attn_out") for layer in range(N_LAYERS)]
    plain = [s.token_id for s in generate_stream(eager, tokens, max_tokens=8, temperature=0.0)]
    changed = 0
    n = tokens.shape[1]
    v = torch.randn(eager.d_model, generator=torch.Generator().manual_seed(5))
    specs = dict(_specs(eager))
    # at generated positions only, deep into decode: steps whose batch keeps its rows but
    # whose writes select by position (the row maps must be refilled, not reused)
    specs["add_at_decode_positions"] = SteerSpec.add("resid_post.1", v, scale=6.0, positions=[n + 2, n + 4])
    for name, spec in specs.items():
        with steer(eager, spec):
            se = list(generate_stream(eager, tokens, max_tokens=8, temperature=0.0, n_logprobs=3))
            ce = run_with_cache(eager, tokens, points)
        with steer(model, spec):
            ss = list(generate_stream(model, tokens, max_tokens=8, temperature=0.0, n_logprobs=3))
            cs = run_with_cache(model, tokens, points)
        _same_steps(se, ss, name)
        for address in points:
            assert_close_scaled(cs[address], ce[address], tol=2e-5, msg=f"{name} {address}")
        changed += [s.token_id for s in se] != plain
    assert changed >= 3  # the specs really steer


def test_concurrent_requests_each_get_their_own_steering_and_captures(qwen3):
    eager, model = qwen3
    tokens = eager.to_tokens(PROMPTS[0])
    specs = [None, *list(_specs(eager).values())[:4]]

    async def texts(m):
        return await asyncio.gather(*[m.generate_text(tokens, max_tokens=8, temperature=0.0, steer=s) for s in specs])

    async def captures(m):
        return await asyncio.gather(*[m.capture_generation(tokens, ["resid_post.1", "mlp_out.2"], max_tokens=5,
                                                           temperature=0.0, steer=s) for s in specs])

    concurrent = asyncio.run(texts(model))
    assert concurrent == asyncio.run(texts(eager))
    assert len(set(concurrent)) > 2
    for (_, got), (_, want) in zip(asyncio.run(captures(model)), asyncio.run(captures(eager))):
        for point in want:
            assert_close_scaled(got[point], want[point], tol=2e-5, msg=str(point))


def test_new_vectors_and_row_maps_never_recompile(qwen3):
    _, model = qwen3
    tokens = model.to_tokens(PROMPTS[1])
    list(generate_stream(model, tokens, max_tokens=2, temperature=0.0))
    before = _info(model)["counts"]
    g = torch.Generator().manual_seed(11)
    outs = set()
    for i in range(4):
        spec = SteerSpec.add(f"resid_post.{i % N_LAYERS}", torch.randn(model.d_model, generator=g), scale=4.0)
        with steer(model, spec):
            outs.add(tuple(s.token_id for s in generate_stream(model, tokens, max_tokens=4, temperature=0.0)))
            run_with_cache(model, tokens[:, : 3 + i], [f"mlp_out.{i % N_LAYERS}"])
    assert len(outs) > 1
    assert _info(model)["counts"] == before


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3_moe", "gpt_oss"])  # gpt_oss: hidden_states first
def test_other_architectures_capture_and_steer_like_eager(model_pool, arch):
    eager = model_pool.get(arch)
    model = model_pool.get(arch, "vllm-static", **_declared())
    tokens = eager.to_tokens(PROMPTS[1])
    points = list(model.static_points)
    ce, cs = run_with_cache(eager, tokens, points), run_with_cache(model, tokens, points)
    for address in points:
        assert_close_scaled(cs[address], ce[address], msg=f"{arch} {address}")
    spec = _specs(eager)["ablate_mid_set_pre"] | SteerSpec.add("mlp_out.0", torch.ones(eager.d_model), scale=2.0)
    with steer(eager, spec):
        se = list(generate_stream(eager, tokens, max_tokens=6, temperature=0.0, n_logprobs=3))
    with steer(model, spec):
        ss = list(generate_stream(model, tokens, max_tokens=6, temperature=0.0, n_logprobs=3))
    _same_steps(se, ss, arch)
    assert _info(model)["counts"]["dynamo_graph_breaks"] == 0


def test_tensor_parallel_two_ranks_equal_one_rank_and_eager(model_pool, qwen3):
    """Two CPU ranks (the backend binds one core to each, VLLM_CPU_OMP_THREADS_BIND="0|1"): the
    declared points are full width after each layer's all-reduce, so every rank's compiled taps
    hold the same rows (rank 0's come back) and every rank applies the same steering; captures,
    steered tokens and logprobs equal one rank and eager."""
    eager, one = qwen3
    two = model_pool.get("qwen3", "vllm-static", tensor_parallel_size=2, **_declared())
    two.warmup()
    assert two.backend.world == 2
    tokens = eager.to_tokens(PROMPTS[1])
    points = [f"{n}.{layer}" for n in NAMES for layer in (0, N_LAYERS - 1)]
    ce, c1, c2 = (run_with_cache(m, tokens, points) for m in (eager, one, two))
    for p in points:
        assert_close_scaled(c2[p], ce[p], msg=f"tp2 vs eager {p}")
        assert_close_scaled(c2[p], c1[p], msg=f"tp2 vs tp1 {p}")
    spec = _specs(eager)["ablate_mid_set_pre"] | SteerSpec.add("attn_out.0", torch.ones(eager.d_model), scale=3.0)
    runs = []
    for model in (eager, one, two):
        with steer(model, spec):
            runs.append(list(generate_stream(model, tokens, max_tokens=8, temperature=0.0, n_logprobs=3)))
    _same_steps(runs[0], runs[2], "tp2 vs eager")
    _same_steps(runs[1], runs[2], "tp2 vs tp1")
    captured = []
    for model in (eager, two):
        with steer(model, spec):
            captured.append(capture_generation(model, tokens, ["resid_post.1", "mlp_out.2"], max_tokens=5,
                                               temperature=0.0)[1])
    expected, values = captured
    for p in ("resid_post.1", "mlp_out.2"):
        assert_close_scaled(values[p], expected[p], tol=2e-5, msg=f"tp2 steered generation {p}")
    assert all(info["counts"]["dynamo_graph_breaks"] == 0 for info in two.backend.rpc("interp_static_info"))
