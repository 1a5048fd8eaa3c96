"""The vLLM backend against the eager backend on the same weights (fp32): every served point,
greedy tokens and logprobs, steering, capture while generating, prompt embeds, async methods,
and refusals before any forward. One engine per architecture for the whole session."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

import importlib.util

from interp_engine import (Address, CapabilityUnsupported, SteerSpec, capture_generation,
                           generate_stream, load_model, run_with_cache, steer)
from interp_engine.testing import assert_close_scaled, tiny_model

from interp_engine.testing import VLLM_ARCHS  # noqa: E402  (from the spec registry)
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                  reason="vllm not installed")]

PROMPTS = ("The capital of France is", "Once upon a time, in a land far away, there lived a café owner")
ATOL, RTOL = 3e-5, 1e-5




@pytest.fixture(params=VLLM_ARCHS)
def pair(request, model_pool):
    arch = request.param
    return model_pool.get(arch), model_pool.get(arch, "vllm", enable_prompt_embeds=True)


def _served_points(model):
    return [Address(p.name, layer) for p in model.points() if p.vllm for layer in model.graph.layers_of(p.name)]


def test_every_served_point_equals_eager(pair):
    eager, vllm = pair
    points = _served_points(vllm)
    assert {a.name for a in points} >= {"resid_pre", _mid(eager), "resid_post", "attn_out", "mlp_out", "z"}
    for prompt in PROMPTS:
        tokens = eager.to_tokens(prompt)
        ce, cv = run_with_cache(eager, tokens, points), run_with_cache(vllm, tokens, points)
        for address in points:
            assert cv[address].shape == ce[address].shape, address
            assert_close_scaled(cv[address], ce[address], msg=str(address))


def test_greedy_tokens_and_logprobs_equal(pair):
    eager, vllm = pair
    for prompt in PROMPTS:
        tokens = eager.to_tokens(prompt)
        se = list(generate_stream(eager, tokens, max_tokens=12, temperature=0.0, n_logprobs=4))
        sv = list(generate_stream(vllm, tokens, max_tokens=12, temperature=0.0, n_logprobs=4))
        assert [s.token_id for s in sv] == [s.token_id for s in se]
        assert all(s.logits is None for s in sv) and all(s.logits is not None for s in se)
        for a, b in zip(se, sv):
            assert [d["token_id"] for d in b.logprobs] == [d["token_id"] for d in a.logprobs]
            torch.testing.assert_close(torch.tensor([d["logprob"] for d in b.logprobs]),
                                       torch.tensor([d["logprob"] for d in a.logprobs]), atol=1e-5, rtol=0)
            assert b.logprob == pytest.approx(a.logprob, abs=1e-5)


def _mid(model):
    """resid_mid, or attn_out on a parallel block (GPT-NeoX), where resid_mid has no meaning."""
    return "attn_out" if model.residual_basis.parallel_block else "resid_mid"


def _specs(model):
    g = torch.Generator().manual_seed(3)
    d, last = model.d_model, model.n_layers - 1
    v = torch.randn(d, generator=g)
    u = torch.randn(d, generator=g)
    return {
        "add_resid_post": SteerSpec.add("resid_post.1", v, scale=3.0),
        "add_last_layer": SteerSpec.add(f"resid_post.{last}", v, scale=2.0),
        "ablate_mid_set_pre": SteerSpec.ablate(f"{_mid(model)}.1", u) | SteerSpec.set("resid_pre.2", v * 2, positions=[3]),
        "attn_mlp_prompt_generated": SteerSpec.add("attn_out.0", v, scale=4.0, positions="prompt")
        | SteerSpec.add("mlp_out.2", u, scale=4.0, positions="generated"),
        "per_position": SteerSpec.add("resid_pre.0", torch.stack([v, u]) * 3, positions=[1, 4]),
        "ablate_resid_post": SteerSpec.ablate("resid_post.0", v),
    }


def test_steered_generation_equals_eager(pair):
    eager, vllm = pair
    tokens = eager.to_tokens(PROMPTS[0])
    plain = [s.token_id for s in generate_stream(eager, tokens, max_tokens=10, temperature=0.0)]
    changed = 0
    for name, spec in _specs(eager).items():
        with steer(eager, spec):
            se = list(generate_stream(eager, tokens, max_tokens=10, temperature=0.0, n_logprobs=3))
        with steer(vllm, spec):
            sv = list(generate_stream(vllm, tokens, max_tokens=10, temperature=0.0, n_logprobs=3))
        assert [s.token_id for s in sv] == [s.token_id for s in se], name
        for a, b in zip(se, sv):
            torch.testing.assert_close(torch.tensor([d["logprob"] for d in b.logprobs]),
                                       torch.tensor([d["logprob"] for d in a.logprobs]), atol=2e-5, rtol=0)
        changed += [s.token_id for s in se] != plain
    assert changed >= 3  # the specs really steer


def test_steered_capture_equals_eager(pair):
    eager, vllm = pair
    tokens = eager.to_tokens(PROMPTS[1])
    points = [Address(n, layer) for n in {_mid(eager), "resid_post", "attn_out"} for layer in range(eager.n_layers)]
    for name, spec in _specs(eager).items():
        with steer(eager, spec):
            ce = run_with_cache(eager, tokens, points)
        with steer(vllm, spec):
            cv = run_with_cache(vllm, tokens, points)
        for address in points:
            assert_close_scaled(cv[address], ce[address], tol=2e-5, msg=f"{name} {address}")


def test_capture_generation_rows_equal_eager(pair):
    eager, vllm = pair
    tokens = eager.to_tokens(PROMPTS[0])
    points = ["resid_post.0", f"resid_post.{eager.n_layers - 1}", "z.1", "attn_out.2", "resid_pre.0"]
    ce_completion, ce = capture_generation(eager, tokens, points, max_tokens=7, temperature=0.0)
    cv_completion, cv = capture_generation(vllm, tokens, points, max_tokens=7, temperature=0.0)
    assert cv_completion.token_ids == ce_completion.token_ids
    assert cv_completion.text == ce_completion.text
    n = tokens.shape[1] + len(cv_completion.token_ids) - 1
    for point in points:
        assert cv[point].shape[1] == n
        assert_close_scaled(cv[point], ce[point], msg=point)


def test_prompt_embeds_give_the_same_tokens_as_ids(pair):
    eager, vllm = pair
    tokens = eager.to_tokens(PROMPTS[1])
    embeds = vllm.embed(tokens)
    torch.testing.assert_close(embeds, eager.embed(tokens), atol=1e-6, rtol=0)
    from vllm import SamplingParams

    out = asyncio.run(vllm.generate_from_embeds(embeds, SamplingParams(max_tokens=8, temperature=0.0)))
    ids = [s.token_id for s in generate_stream(vllm, tokens, max_tokens=8, temperature=0.0)]
    assert list(out.outputs[0].token_ids) == ids
    eager_out = asyncio.run(eager.generate_from_embeds(embeds, SamplingParams(max_tokens=8, temperature=0.0)))
    assert list(eager_out.outputs[0].token_ids) == ids


def test_prompt_embeds_bad_input(pair):
    _, vllm = pair
    good = vllm.embed(vllm.to_tokens("Hi there"))
    for bad, word in ((good[:, :-1], r"embeds is a tensor of shape \[\d+, 127\].*d_model=128"),
                      (good.double(), "dtype"), (good[None], r"shape \[1, \d+, 128\].*\[pos, d_model\]"),
                      (good[:0], "empty")):
        with pytest.raises((ValueError, TypeError), match=word):
            asyncio.run(vllm.generate_from_embeds(bad))


def test_embeds_need_enable_prompt_embeds():
    model = load_model(tiny_model("qwen3"), backend="vllm")  # lazy: no engine starts
    with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
        asyncio.run(model.generate_from_embeds(torch.zeros(3, model.d_model)))
    assert model.backend._llm is None


def test_a_cpu_engine_reserves_the_kv_cache_its_model_can_use_not_a_gibibyte_each(monkeypatch):
    """Each byte of a CPU engine's KV cache is resident memory: a tiny model gets the 64 MiB
    floor, a real one the 1 GiB cap, a middle one 64 whole contexts; what the caller passes wins."""
    import dataclasses

    from bridge.vllm.client import cpu_kv_bytes

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    model = load_model(tiny_model("qwen3"), backend="vllm")  # lazy: no engine starts
    graph = model.graph
    assert model.backend._kwargs["kv_cache_memory_bytes"] == cpu_kv_bytes(graph, torch.float32,
                                                                          model.max_model_len) == 64 << 20
    real = dataclasses.replace(graph, n_layers=36, n_kv_heads=8, d_head=128)  # Qwen3-8B's KV
    assert cpu_kv_bytes(real, torch.bfloat16, 40960) == 1 << 30
    middle = dataclasses.replace(graph, n_layers=4, n_kv_heads=2, d_head=64)  # 4 KiB a token in float32
    assert cpu_kv_bytes(middle, torch.float32, 2048) == 64 * 2048 * (2 * 4 * 2 * 64 * 4)
    own = load_model(tiny_model("qwen3"), backend="vllm", kv_cache_memory_bytes=32 << 20)
    assert own.backend._kwargs["kv_cache_memory_bytes"] == 32 << 20
    assert model.backend._llm is None and own.backend._llm is None


def test_concurrent_async_requests_each_get_their_own_result(pair):
    eager, vllm = pair
    tokens = eager.to_tokens(PROMPTS[0])
    specs = [None, *list(_specs(eager).values())[:3]]

    async def run(model):
        return await asyncio.gather(*[model.generate_text(tokens, max_tokens=8, temperature=0.0, steer=s)
                                      for s in specs])

    concurrent = asyncio.run(run(vllm))
    one_by_one = [asyncio.run(vllm.generate_text(tokens, max_tokens=8, temperature=0.0, steer=s)) for s in specs]
    assert concurrent == one_by_one == asyncio.run(run(eager))
    assert len(set(concurrent)) > 1


def test_concurrent_requests_adding_different_vectors_each_get_their_own(model_pool):
    """The worker adds the vectors of the requests that each add one at every position in one
    step-wide sum: each request must still get its own vector on its own rows (prompt rows in
    the first step, one row per decode step), next to requests that steer otherwise or not at all."""
    eager, vllm = model_pool.get("qwen3"), model_pool.get("qwen3", "vllm", enable_prompt_embeds=True)
    L, last = 1, Address("resid_post", eager.n_layers - 1)
    g = torch.Generator().manual_seed(11)
    vectors = [torch.randn(eager.d_model, generator=g) for _ in range(4)]
    specs = [SteerSpec.add(f"resid_post.{L}", v, scale=4.0) for v in vectors]
    specs += [SteerSpec.add(f"resid_post.{L}", vectors[0], scale=4.0, positions="prompt"), None,
              SteerSpec.add(f"resid_post.{L}", vectors[1], scale=4.0) | SteerSpec.scale(f"resid_post.{L}", 0.5)]
    prompts = [eager.to_tokens(PROMPTS[i % len(PROMPTS)])[:, : 5 + i] for i in range(len(specs))]

    async def run(model):
        return await asyncio.gather(*[model.capture_generation(p, [last], max_tokens=6, temperature=0.0,
                                                               stop_at_eos=False, steer=s)
                                      for p, s in zip(prompts, specs)])

    got = asyncio.run(run(vllm))
    for k, (p, s) in enumerate(zip(prompts, specs)):
        want = asyncio.run(eager.capture_generation(p, [last], max_tokens=6, temperature=0.0, stop_at_eos=False,
                                                    steer=s))
        assert got[k][0].token_ids == want[0].token_ids, f"request {k}: {s}"
        assert_close_scaled(got[k][1][last], want[1][last], msg=f"request {k}: {s}")


def test_async_stream_and_full(pair):
    _, vllm = pair
    tokens = vllm.to_tokens(PROMPTS[1])

    async def go():
        text = await vllm.generate_text(tokens, max_tokens=16, temperature=0.0)
        deltas = [d async for d in vllm.generate_stream(tokens, max_tokens=16, temperature=0.0)]
        full = await vllm.generate_full(tokens, max_tokens=16, temperature=0.0, logprobs=3)
        return text, deltas, full

    text, deltas, full = asyncio.run(go())
    assert "".join(deltas) == text == full.text
    from vllm.outputs import RequestOutput

    assert isinstance(full, RequestOutput)
    assert full.finish_reason in ("length", "stop")
    assert len(full.logprobs) == len(full.token_ids)
    assert full.text == vllm.to_string(full.token_ids)


def test_seeded_sampling_repeats(pair):
    _, vllm = pair
    tokens = vllm.to_tokens(PROMPTS[0])
    runs = [[s.token_id for s in generate_stream(vllm, tokens, max_tokens=12, temperature=1.0, top_p=0.9,
                                                 top_k=50, seed=seed)] for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_refusals_before_any_forward():
    model = load_model(tiny_model("qwen3"), backend="vllm")  # lazy: no engine yet
    tokens = model.to_tokens("Hi")
    assert model.hooks_available and not model.graph_replay
    assert model.static_points == () and model.static_writes == ()
    assert not model.grad_support.through_forward
    with pytest.raises(CapabilityUnsupported, match="batched_prompts"):
        run_with_cache(model, model.tok.to_tokens(["a b", "c"]), ["resid_post.0"])
    with pytest.raises(CapabilityUnsupported, match="gradients"):
        run_with_cache(model, tokens, ["resid_post.0"], detach=False)
    with pytest.raises(CapabilityUnsupported, match="logits_in_stream"):
        run_with_cache(model, tokens, ["resid_post.0"], return_logits=True)
    from interp_engine import decode_residuals

    with pytest.raises(CapabilityUnsupported, match="free_decode_residuals"):
        decode_residuals(model, torch.zeros(1, 1, model.d_model))
    with pytest.raises(CapabilityUnsupported, match="gradients"):
        load_model(tiny_model("qwen3"), backend="vllm", requires_grad=True)
    with pytest.raises(CapabilityUnsupported, match="vllm_architecture"):
        load_model(tiny_model("deepseek_v4"), backend="vllm")
    assert model.backend._llm is None  # nothing above started the engine


def test_moe_routing_on_vllm(model_pool):
    eager = model_pool.get("qwen3_moe")
    vllm = model_pool.get("qwen3_moe", "vllm", enable_prompt_embeds=True)
    tokens = eager.to_tokens(PROMPTS[1])
    from interp_engine import expert_assignment

    cv = run_with_cache(vllm, tokens, ["router_logits.1"])
    ce = run_with_cache(eager, tokens, ["router_logits.1", "expert_indices.1", "expert_weights.1"])
    dense_v = expert_assignment(cv, 1, eager.graph.n_experts, top_k=eager.graph.top_k)
    torch.testing.assert_close(dense_v, expert_assignment(ce, 1, eager.graph.n_experts), atol=1e-5, rtol=1e-5)


def test_lens_runs_where_the_weights_are(pair):
    eager, vllm = pair
    tokens = eager.to_tokens(PROMPTS[0])
    points = [Address("resid_post", layer) for layer in range(eager.n_layers)]
    lv = vllm.decode_residuals(run_with_cache(vllm, tokens, points))
    le = eager.decode_residuals(run_with_cache(eager, tokens, points))
    torch.testing.assert_close(lv, le, atol=5e-5, rtol=1e-5)
    first = next(generate_stream(vllm, tokens, max_tokens=1, temperature=0.0, n_logprobs=3))
    assert int(lv[-1, 0, -1].argmax()) == first.token_id
    assert float(lv[-1, 0, -1].max()) == pytest.approx(first.logprobs[0]["logprob"], abs=1e-5)


def test_chunked_prefill_and_concurrent_captures_map_rows_back(model_pool):
    """A small token budget splits long prompts into chunks and mixes them with other requests'
    decode rows in one batch: every captured row must still land at its request and position."""
    eager = model_pool.get("qwen3")
    vllm = model_pool.get("qwen3", "vllm", max_num_batched_tokens=16, max_num_seqs=4, max_model_len=512)
    prompt = eager.to_tokens("Once upon a time, in a land far away, there lived a café owner who "
                             "sold bread, cheese and wine to travellers on the long road north")
    assert prompt.shape[1] > 40  # several 16-token chunks
    points = ["resid_post.0", "resid_pre.2", "z.1"]
    ce_completion, ce = capture_generation(eager, prompt, points, max_tokens=6, temperature=0.0)
    vllm.warmup()
    before = vllm.backend.worker_stats()[0]["forwards"]
    cv_completion, cv = capture_generation(vllm, prompt, points, max_tokens=6, temperature=0.0)
    stats = vllm.backend.worker_stats()[0]
    sizes = stats["forward_rows"][-(stats["forwards"] - before):]
    assert sum(1 for n in sizes if n > 1) >= 3 and max(sizes) <= 16  # the prompt really was chunked
    assert cv_completion.token_ids == ce_completion.token_ids
    for point in points:
        assert_close_scaled(cv[point], ce[point], msg=point)
    # other requests in flight at the same time (async) do not disturb a steered one
    spec = SteerSpec.add("resid_post.1", torch.ones(eager.d_model), scale=2.0)

    async def crowd():
        others = [vllm.generate_text(prompt[0, : 10 + 7 * i].tolist(), max_tokens=6, temperature=0.0)
                  for i in range(3)]
        mine = vllm.generate_text(prompt, max_tokens=6, temperature=0.0, steer=spec)
        return await asyncio.gather(mine, *others)

    results = asyncio.run(crowd())
    with steer(eager, spec):
        expected = eager.to_string([s.token_id for s in generate_stream(eager, prompt, max_tokens=6, temperature=0.0)])
    assert results[0] == expected
    for i, text in enumerate(results[1:]):
        ids = prompt[0, : 10 + 7 * i].tolist()
        assert text == eager.to_string([s.token_id for s in generate_stream(eager, ids, max_tokens=6,
                                                                            temperature=0.0)])
    # a steering-only request is settled from the status board and freed by the workers at their
    # next step (when vLLM's model runner lets it go): one tiny request later, nothing is held
    list(generate_stream(vllm, [5, 6], max_tokens=1, temperature=0.0))
    assert all(s["live"] == 0 and s["by_rid"] == 0 and s["finished"] == 0 for s in vllm.backend.worker_stats())


def test_concurrent_captures_come_back_through_the_rows_file_equal_to_eager(model_pool, monkeypatch):
    """Requests that end in one step are collected with one rpc; a multiprocess engine's workers
    write their rows into the client's rows file (bridge/vllm/spill.py) instead of the rpc's
    answer. Every row equals eager's, the file really carried them, and no file is left."""
    eager, vllm = model_pool.get("qwen3"), model_pool.get("qwen3", "vllm")
    vllm.warmup()
    backend = vllm.backend
    assert not backend.in_process and backend._spill is not None
    monkeypatch.setattr(backend._inbox, "take", lambda nbytes, held=False: None)  # no room in the inbox (inbox.py): by rpc
    points = [Address(name, layer) for name in ("resid_post", "mlp_out", "z") for layer in range(eager.n_layers)]
    prompts = [eager.to_tokens(p)[0].tolist() for p in PROMPTS] * 3
    spilled, take = [], backend._spill.take

    def spy(base, answers):
        take(base, answers)
        spilled.extend(a for per_rank in answers for a in per_rank if a.get("spilled"))
        assert not any(os.path.exists(f"{base}.{rank}") for rank in range(backend.world))

    backend._spill.take = spy
    try:
        async def run():
            return await asyncio.gather(*[vllm.capture_generation(p, points, max_tokens=5, temperature=0.0,
                                                                  stop_at_eos=False) for p in prompts])
        results = asyncio.run(run())
    finally:
        del backend._spill.take
    assert spilled  # the rows came through the file, not the answer
    for prompt, (completion, rows) in zip(prompts, results):
        ce_completion, ce = capture_generation(eager, torch.tensor([prompt]), points, max_tokens=5,
                                               temperature=0.0, stop_at_eos=False)
        assert completion.token_ids == ce_completion.token_ids
        for point in points:
            assert_close_scaled(rows[point], ce[point], msg=point)


def test_head_contributions_run_where_the_weights_are(pair):
    eager, vllm = pair
    from interp_engine import head_contributions

    tokens = eager.to_tokens(PROMPTS[1])
    points = ["z.1", "attn_out.1"]
    ce, cv = run_with_cache(eager, tokens, points), run_with_cache(vllm, tokens, points)
    hv = head_contributions(vllm, cv, 1)
    assert hv.shape == (1, tokens.shape[1], eager.graph.n_heads, eager.d_model)
    assert_close_scaled(hv, head_contributions(eager, ce, 1), msg="heads")
    eager_map = eager.backend.spec.eager
    # Sandwich-norm models (Gemma 2/3, OLMo 2) normalise attention's output before adding it:
    # there attn_out is read at a norm after the attention module, and is no sum over heads.
    if eager_map["attn_out"].path == eager_map["pattern"].path:
        o_proj = eager.hf.get_submodule(eager.backend.spec.eager["z"].module_path(1))
        bias = o_proj.bias if o_proj.bias is not None else 0.0  # GPT-2's c_proj has one
        assert_close_scaled(hv.sum(2) + bias, cv["attn_out.1"], msg="sum over heads")


def test_starting_an_engine_leaves_the_callers_random_streams_alone():
    import random

    model = load_model(tiny_model("llama"), backend="vllm")
    torch.manual_seed(1234)
    random.seed(1234)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(1234)
    random.seed(1234)
    model.warmup()  # vLLM's LLM(seed=0) reseeds the process generators
    try:
        assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    finally:
        model.backend.close()


def test_dropping_a_vllm_model_leaves_other_engines_working(model_pool):
    import gc

    survivor = model_pool.get("qwen3", "vllm", enable_prompt_embeds=True)
    tokens = survivor.to_tokens(PROMPTS[0])
    before = [s.token_id for s in generate_stream(survivor, tokens, max_tokens=4, temperature=0.0)]
    doomed = load_model(tiny_model("llama"), backend="vllm")
    doomed.warmup()
    del doomed
    gc.collect()  # vLLM's own finalizer would tear down the process-wide parallel state here
    assert [s.token_id for s in generate_stream(survivor, tokens, max_tokens=4, temperature=0.0)] == before


# ---- the core's promises hold inside vLLM too ----------------------------------------------

def test_editing_a_vector_after_building_the_spec_changes_neither_backend(model_pool):
    eager = model_pool.get("qwen3")
    vllm = model_pool.get("qwen3", "vllm", enable_prompt_embeds=True)
    tokens = eager.to_tokens(PROMPTS[0])
    v = torch.randn(eager.d_model, generator=torch.Generator().manual_seed(8)) * 3
    spec = SteerSpec.set("resid_post.1", v, positions=[2]) | SteerSpec.add("mlp_out.0", v, scale=2.0)
    results = []
    for model in (eager, vllm, eager, vllm):
        with steer(model, spec):
            results.append(run_with_cache(model, tokens, ["resid_post.2"])["resid_post.2"])
        v.mul_(-1.0)  # in place, between every run: the spec keeps the vector it was built with
    for got in results[1:]:
        assert_close_scaled(got, results[0], msg="same spec, edited source vector")


def test_stop_tokens_and_min_tokens_equal_plain_vllm(model_pool):
    from vllm import SamplingParams

    eager = model_pool.get("qwen3")
    vllm = model_pool.get("qwen3", "vllm", enable_prompt_embeds=True)
    tokens = eager.to_tokens(PROMPTS[0])
    free = [s.token_id for s in generate_stream(eager, tokens, max_tokens=12, temperature=0.0, stop_at_eos=False)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[free[5]],
                            min_tokens=2)
    embeds = vllm.embed(tokens)
    ours = asyncio.run(vllm.generate_from_embeds(embeds, params))
    theirs = asyncio.run(eager.generate_from_embeds(eager.embed(tokens), params))
    plain = vllm.backend._engine().generate([{"prompt_token_ids": tokens[0].tolist()}], params, use_tqdm=False)
    assert list(ours.token_ids) == list(plain[0].outputs[0].token_ids) == list(theirs.token_ids)
    assert ours.finish_reason == plain[0].outputs[0].finish_reason == theirs.finish_reason == "stop"
    with pytest.raises(ValueError, match=r"SamplingParams\.n=3 is not honoured"):
        asyncio.run(vllm.generate_from_embeds(embeds, SamplingParams(n=3)))


def test_both_backends_stop_at_the_end_of_the_context(model_pool):
    eager = load_model(tiny_model("llama"), max_model_len=24)
    vllm = load_model(tiny_model("llama"), backend="vllm", max_model_len=24)
    try:
        assert eager.max_model_len == vllm.max_model_len == 24
        ids = list(range(5, 23))  # 18 tokens
        ce, cv = (capture_generation(m, ids, ["resid_post.0"], max_tokens=50, temperature=0.0, stop_at_eos=False)
                  for m in (eager, vllm))
        assert ce[0].token_ids == cv[0].token_ids and len(cv[0].token_ids) == 6
        assert ce[0].finish_reason == cv[0].finish_reason == "length"
        assert_close_scaled(cv[1]["resid_post.0"], ce[1]["resid_post.0"], msg="rows to the context end")
        with pytest.raises(ValueError, match="context holds 24"):
            list(generate_stream(vllm, list(range(5, 29)), max_tokens=1))
    finally:
        vllm.close()


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_model_len="abc"), r"max_model_len must be a positive int, got .abc."),
    (dict(max_num_batched_tokens="many"), r"max_num_batched_tokens='many' has the wrong type"),
    (dict(max_num_seq=4), r"unknown vLLM engine argument 'max_num_seq'; did you mean 'max_num_seqs'"),
    (dict(tensor_parallel_size=1.5), r"tensor_parallel_size=1.5 has the wrong type"),
])
def test_bad_engine_arguments_are_named_before_any_engine_starts(kwargs, match):
    with pytest.raises(TypeError, match=match):
        load_model(tiny_model("qwen3"), backend="vllm", **kwargs)


def test_each_request_gets_sampling_params_equal_to_freshly_built_ones_and_shares_nothing(model_pool):
    """SamplingParams are built once per sampling config and copied per request: each copy must
    be what building them afresh gives (with its own plan in extra_args), and own every
    container vLLM's input processor edits in place, even after a request went through it."""
    from interp_engine._sampling import SamplingConfig

    vllm = model_pool.get("qwen3", "vllm", enable_prompt_embeds=True)
    backend = vllm.backend
    config = SamplingConfig(max_tokens=3, temperature=0.0, stop_token_ids=(7, 9), min_tokens=1)
    first = backend._sampling_params(config, None)
    backend._engine().generate([{"prompt_token_ids": vllm.to_tokens(PROMPTS[0])[0].tolist()}], first,
                               use_tqdm=False)  # vLLM's input processor edits it in place
    second = backend._sampling_params(config, {"interp_engine": {"rid": "b"}})
    fresh = backend._new_sampling_params(config, True)
    for name in type(fresh).__struct_fields__:
        if name != "extra_args":
            assert getattr(second, name) == getattr(fresh, name), name
    assert second.extra_args == {"interp_engine": {"rid": "b"}} and first.extra_args is None
    assert second._all_stop_token_ids is not first._all_stop_token_ids
    assert second.stop_token_ids is not first.stop_token_ids
    other = backend._sampling_params(SamplingConfig(max_tokens=4, temperature=0.0), None)
    assert other.max_tokens == 4 and other.extra_args is None and second.max_tokens == 3
