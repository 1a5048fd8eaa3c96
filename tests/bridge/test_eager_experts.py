"""Per-expert writes (``experts=`` at an MoE layer's mlp_out) on the eager bridge, against
references written on the Hugging Face modules: the block's input and output are read with this
file's own hooks, each expert's share of the output is recomputed by calling the HF experts
module with only that expert's routing weights (and, for Qwen3-MoE, from the expert's weight
matrices by hand), and the ablated or scaled output must equal the clean one minus (or plus a
multiple of) that share."""

from __future__ import annotations

import pytest
import torch

from interp_engine import SteerSpec, generate_stream, run_with_cache, steer
from interp_engine.testing import assert_close_scaled
from tests._reference import PROMPT, count_forwards

MOE_ARCHS = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v4")


def _block(model, layer: int):
    return model.hf.model.layers[layer].mlp


def _router(block):
    return block.router if hasattr(block, "router") else block.gate


def _block_io(model, ids, layer: int, steer=None):
    """The MoE block's input and output (HF's own tensors, read by hooks written here) in a run
    of the library with ``steer``."""
    block, got = _block(model, layer), {}

    def pre(mod, args, kwargs):
        got["x"] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

    def post(mod, args, out):
        got["y"] = (out[0] if isinstance(out, tuple) else out).detach().clone()
    handles = [block.register_forward_pre_hook(pre, with_kwargs=True), block.register_forward_hook(post)]
    try:
        run_with_cache(model, ids, [], steer=steer)
    finally:
        for h in handles:
            h.remove()
    return got["x"], got["y"]


def _shares(model, ids, x: torch.Tensor, layer: int, expert: int) -> torch.Tensor:
    """Expert ``expert``'s share of the block's output at each position ``[batch, pos, d_model]``:
    HF's experts module run on the router's own selection with every other weight zeroed."""
    block = _block(model, layer)
    flat = x.reshape(-1, x.shape[-1])
    router = _router(block)
    with torch.no_grad():
        if getattr(block, "is_hash", False):
            _, weights, indices = router(x, ids)
        else:
            _, weights, indices = router(flat)
        only = torch.where(indices == expert, weights, torch.zeros_like(weights))
        return block.experts(flat, indices, only).reshape(x.shape)


def _busy_expert(model, ids, x: torch.Tensor, layer: int) -> int:
    """The expert the router picks most often on this prompt (so a write to it is seen)."""
    block = _block(model, layer)
    with torch.no_grad():
        if getattr(block, "is_hash", False):
            _, _, indices = _router(block)(x, ids)
        else:
            _, _, indices = _router(block)(x.reshape(-1, x.shape[-1]))
    return int(torch.bincount(indices.flatten()).argmax())


def expert_case(model, ids, layer: int):
    """The HF reference at an MoE layer: the block's input and clean output, the expert the
    router picks most, and that expert's share of the output (checked to be used)."""
    x, clean = _block_io(model, ids, layer)
    expert = _busy_expert(model, ids, x, layer)
    share = _shares(model, ids, x, layer, expert)
    assert share.abs().max() > 0  # the expert is used on this prompt
    return x, clean, expert, share


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_zeroing_and_scaling_an_expert_remove_and_scale_its_share(eager_models, arch):
    model = eager_models[arch]
    ids = model.to_tokens(PROMPT)
    layer = model.graph.moe_layers[-1]
    site = f"mlp_out.{layer}"
    x, clean, expert, share = expert_case(model, ids, layer)

    x_zero, zeroed = _block_io(model, ids, layer, SteerSpec.zero(site, experts=[expert]))
    assert torch.equal(x_zero, x)  # a write at this layer leaves its input alone
    assert_close_scaled(zeroed, clean - share)

    positions = [1, 3]
    _, scaled = _block_io(model, ids, layer, SteerSpec.scale(site, 2.5, positions=positions, experts=[expert]))
    expected = clean.clone()
    expected[:, positions] += 1.5 * share[:, positions]
    assert_close_scaled(scaled, expected)
    others = [p for p in range(ids.shape[1]) if p not in positions]
    assert torch.equal(scaled[:, others], clean[:, others])  # other positions untouched, bit for bit


def test_expert_share_by_hand_from_the_expert_weight_matrices(eager_models):
    """Qwen3-MoE: the removed share is ``w_e * (silu(x G_e) * (x U_e)) D_e`` at the positions
    routed to expert e, computed here from the experts module's parameters."""
    model = eager_models["qwen3_moe"]
    ids = model.to_tokens(PROMPT)
    layer = model.graph.moe_layers[0]
    block = _block(model, layer)
    x, clean = _block_io(model, ids, layer)
    expert = _busy_expert(model, ids, x, layer)
    flat = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        logits = flat @ block.gate.weight.T
        probs = torch.softmax(logits.float(), dim=-1)
        top, idx = probs.topk(model.graph.top_k, dim=-1)
        if model.hf.config.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        gate, up = (flat @ block.experts.gate_up_proj[expert].T).chunk(2, dim=-1)
        out = (torch.nn.functional.silu(gate) * up) @ block.experts.down_proj[expert].T
        weight = (top * (idx == expert)).sum(-1, keepdim=True).to(out.dtype)
    share = (weight * out).reshape(x.shape)
    assert share.abs().max() > 0
    _, zeroed = _block_io(model, ids, layer, SteerSpec.zero(f"mlp_out.{layer}", experts=[expert]))
    assert_close_scaled(zeroed, clean - share)


def test_an_expert_write_changes_the_output_and_scale_one_is_the_identity(eager_models):
    model = eager_models["qwen3_moe"]
    ids = model.to_tokens(PROMPT)
    layer = model.graph.moe_layers[0]
    site = f"mlp_out.{layer}"
    every = list(range(model.graph.n_experts))
    clean, cache = run_with_cache(model, ids, [f"expert_weights.{layer}", f"expert_indices.{layer}"],
                                  return_logits=True)
    same, _ = run_with_cache(model, ids, [], return_logits=True, steer=SteerSpec.scale(site, 1.0, experts=every))
    assert torch.equal(same, clean)
    knocked, routed = run_with_cache(model, ids, [f"expert_weights.{layer}", f"expert_indices.{layer}"],
                                     return_logits=True, steer=SteerSpec.zero(site, experts=[0, 1]))
    assert (knocked - clean).abs().max() > 1e-3
    # the routing points show the router's own choice; the experts receive the written weights
    assert torch.equal(routed[f"expert_weights.{layer}"], cache[f"expert_weights.{layer}"])
    assert torch.equal(routed[f"expert_indices.{layer}"], cache[f"expert_indices.{layer}"])
    # zeroing every expert leaves the block's output at exactly zero
    x, zeroed = _block_io(model, ids, layer, SteerSpec.zero(site, experts=every))
    assert zeroed.abs().max() == 0


def test_expert_writes_during_generation_and_in_a_batch(eager_models):
    """Decode steps see a write at generated positions while the prompt's forward does not; a
    padded batch gets the same rows as each prompt alone."""
    model = eager_models["mixtral"]
    layer = model.graph.moe_layers[0]
    spec = SteerSpec.zero(f"mlp_out.{layer}", positions="generated", experts=[0, 3, 5])

    def run():
        return list(generate_stream(model, model.to_tokens("The capital of"), max_tokens=6, temperature=0.0, n_logprobs=1))
    plain = run()
    with steer(model, spec):
        steered = run()
    # the prompt's forward is untouched, so the first token's distribution is the same
    assert steered[0].logprob == pytest.approx(plain[0].logprob, abs=1e-6)
    assert [s.logprob for s in steered] != [s.logprob for s in plain]

    prompts = [model.to_tokens(p)[0].tolist() for p in ("The capital of France is", "Paris")]
    one = SteerSpec.scale(f"mlp_out.{layer}", 0.25, experts=[2])
    together = run_with_cache(model, prompts, [f"mlp_out.{layer}"], steer=one)[f"mlp_out.{layer}"]
    for row, prompt in enumerate(prompts):
        alone = run_with_cache(model, [prompt], [f"mlp_out.{layer}"], steer=one)[f"mlp_out.{layer}"]
        assert_close_scaled(together[row, :alone.shape[1]], alone[0])


def test_bad_expert_writes_are_refused_before_any_forward(eager_models):
    moe, dense = eager_models["qwen3_moe"], eager_models["qwen3"]
    E = moe.graph.n_experts
    bad = [
        (moe, lambda: SteerSpec.zero("mlp_out.0", experts=[E]), ValueError, rf"\[{E}\] out of range.*{E} experts"),
        (moe, lambda: SteerSpec.add("mlp_out.0", torch.ones(moe.d_model), experts=[1]), ValueError,
         "only zero and scale"),
        (moe, lambda: SteerSpec.zero("resid_post.0", experts=[1]), ValueError, "experts= does not apply"),
        (moe, lambda: SteerSpec.zero("mlp_out.0", experts=[1, 1]), ValueError, "repeats"),
        (moe, lambda: SteerSpec.zero("mlp_out.0", experts=[1], heads=[0]), ValueError, "one selector"),
        (dense, lambda: SteerSpec.zero("mlp_out.0", experts=[1]), ValueError, "no MoE layers"),
    ]
    dense_layers = [i for i in range(moe.n_layers) if i not in moe.graph.moe_layers]
    if dense_layers:
        bad.append((moe, lambda: SteerSpec.zero(f"mlp_out.{dense_layers[0]}", experts=[0]), ValueError, "is dense"))
    for model, build, exc, pattern in bad:
        with count_forwards(model.hf) as calls:
            with pytest.raises(exc, match=pattern):
                run_with_cache(model, model.to_tokens(PROMPT), [], steer=build())
        assert calls == []


def test_expert_writes_are_frozen_content_equal_data():
    a = SteerSpec.scale("mlp_out.1", 0.5, experts=[3, 1])
    assert a == SteerSpec.scale("mlp_out.1", 0.5, experts=(3, 1))
    assert a != SteerSpec.scale("mlp_out.1", 0.5, experts=[3])
    assert a.ops[0].experts == (3, 1) and SteerSpec.zero("mlp_out.1").ops[0].experts is None
    with pytest.raises(AttributeError):
        a.ops[0].select = None
