"""The logit lens: ``model.decode_residuals`` (portable, log-probs) and the free
``decode_residuals`` (eager, raw logits), against the model's own logits and a hand-written
final norm + unembedding (+ Gemma 2's final soft-cap)."""

from __future__ import annotations

import pytest
import torch

from interp_engine import Address, CapabilityUnsupported, decode_residuals, run_with_cache
from tests._reference import PROMPT, PROMPTS, final_norm

TOL = dict(rtol=1e-5, atol=1e-5)
SINGLE = ("qwen3", "llama", "gemma2", "qwen3_moe")


def _all_resid_post(model, tokens):
    points = [Address("resid_post", L) for L in range(model.n_layers)]
    return run_with_cache(model, tokens, points, return_logits=True)


def _by_hand(model, resid):
    hf = model.hf
    with torch.no_grad():
        logits = hf.lm_head(final_norm(hf)(resid))
        cap = getattr(hf.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
    return logits


@pytest.mark.parametrize("arch", SINGLE)
def test_lens_on_the_last_layer_is_the_models_logprobs(eager_models, arch):
    model = eager_models[arch]
    ids = model.to_tokens(PROMPT)
    logits, cache = _all_resid_post(model, ids)
    lens = model.decode_residuals(cache)
    assert lens.shape == (model.n_layers, 1, ids.shape[1], model.d_vocab)
    torch.testing.assert_close(lens.logsumexp(-1), torch.zeros(lens.shape[:-1]), rtol=0, atol=1e-4)
    torch.testing.assert_close(lens[-1], torch.log_softmax(logits.float(), -1), **TOL)
    for L in range(model.n_layers):
        want = torch.log_softmax(_by_hand(model, cache.get("resid_post", L)).float(), -1)
        torch.testing.assert_close(lens[L], want, **TOL)
    assert not torch.allclose(lens[0], lens[-1], atol=1e-2)


def test_gemma2_soft_cap_is_applied(eager_models):
    model = eager_models["gemma2"]
    cap = model.hf.config.final_logit_softcapping
    assert cap and model.graph.final_logit_softcap == cap
    cache = run_with_cache(model, model.to_tokens(PROMPT), ["resid_post.1"])
    raw = decode_residuals(model, cache["resid_post.1"])
    assert raw.abs().max() < cap
    hf = model.hf
    with torch.no_grad():
        uncapped = hf.lm_head(hf.model.norm(cache["resid_post.1"]))
    torch.testing.assert_close(raw, torch.tanh(uncapped / cap) * cap, **TOL)
    assert not torch.allclose(raw, uncapped, atol=1e-3)  # the cap matters on this model


@pytest.mark.parametrize("arch", SINGLE)
def test_free_decode_residuals_is_raw_logits(eager_models, arch):
    model = eager_models[arch]
    ids = model.to_tokens(PROMPT)
    logits, cache = _all_resid_post(model, ids)
    last = cache.get("resid_post", model.n_layers - 1)
    raw = decode_residuals(model, last)
    assert raw.shape == (1, ids.shape[1], model.d_vocab)
    torch.testing.assert_close(raw, logits, **TOL)
    one = decode_residuals(model, last[0, 3])
    assert one.shape == (model.d_vocab,)
    torch.testing.assert_close(one, logits[0, 3], **TOL)
    torch.testing.assert_close(model.decode_residuals(last, log_probs=False), raw, **TOL)
    torch.testing.assert_close(model.decode_residuals(last), torch.log_softmax(raw.float(), -1), **TOL)


def test_top_k_and_points(eager_models):
    model = eager_models["llama"]
    _, cache = _all_resid_post(model, model.to_tokens(PROMPT))
    full = model.decode_residuals(cache)
    ids, values = model.decode_residuals(cache, top_k=5)
    assert ids.shape == values.shape == full.shape[:-1] + (5,)
    ref = torch.topk(full, 5, dim=-1)
    assert torch.equal(ids, ref.indices)
    torch.testing.assert_close(values, ref.values)
    torch.testing.assert_close(full.gather(-1, ids), values)
    assert torch.all(values[..., :-1] >= values[..., 1:])
    some = model.decode_residuals(cache, points=["resid_post.2", "resid_post.0"])
    torch.testing.assert_close(some, full[[2, 0]])
    logits = model.decode_residuals(cache, log_probs=False)
    torch.testing.assert_close(torch.log_softmax(logits, -1), full, **TOL)
    for bad in (0, model.d_vocab + 1, -2):
        with pytest.raises(ValueError, match="top_k"):
            model.decode_residuals(cache, top_k=bad)


def test_lens_on_a_padded_batch(eager_models):
    model = eager_models["qwen3"]
    batch = model.tok.to_tokens(list(PROMPTS))
    logits, cache = _all_resid_post(model, batch)
    lens = model.decode_residuals(cache)
    assert lens.shape == (model.n_layers, 2, batch.ids.shape[1], model.d_vocab)
    n = batch.lengths[1]
    torch.testing.assert_close(lens[-1, 1, :n], torch.log_softmax(logits[1, :n].float(), -1), **TOL)


def test_lens_keeps_gradients(eager_models):
    model = eager_models["qwen3"]
    resid = torch.randn(2, model.d_model, requires_grad=True)
    decode_residuals(model, resid).logsumexp(-1).sum().backward()
    assert resid.grad is not None and resid.grad.abs().sum() > 0
    detached = decode_residuals(model, resid.detach())
    assert not detached.requires_grad


def test_lens_errors(eager_models):
    model = eager_models["qwen3"]
    cache = run_with_cache(model, model.to_tokens(PROMPT), ["mlp_out.0"])
    with pytest.raises(ValueError, match="no resid_post"):
        model.decode_residuals(cache)
    with pytest.raises(ValueError, match=r"shape \[3, 64\].*d_model=128 on this"):
        model.decode_residuals(torch.randn(3, 64))
    with pytest.raises(TypeError, match="Cache or a tensor"):
        model.decode_residuals([1.0, 2.0])
    with pytest.raises(KeyError, match=r"resid_post\.1"):
        model.decode_residuals(cache, points=["resid_post.1"])
    with pytest.raises((ValueError, TypeError), match="d_model|resid"):
        decode_residuals(model, torch.randn(3, 64))


def test_deepseek_refuses_the_lens(eager_models):
    model = eager_models["deepseek_v4"]
    assert not model.residual_basis.lens_valid
    cache = run_with_cache(model, model.to_tokens(PROMPT), ["resid_post.2", "resid_streams.2.0"])
    for call in (lambda: model.decode_residuals(cache),
                 lambda: model.decode_residuals(cache["resid_streams.2.0"]),
                 lambda: decode_residuals(model, cache["resid_streams.2.0"])):
        with pytest.raises(CapabilityUnsupported) as info:
            call()
        exc = info.value
        assert exc.capability == "logit_lens" and exc.backend == "eager"
        message = str(exc)
        assert "deepseek_v4" in message and "4 parallel residual streams" in message
        assert exc.why in message and exc.instead in message and "resid_streams" in exc.instead
