"""TransformerLens hook names as a way in (interp_engine._tl), and the docs table that lists them."""

from __future__ import annotations

import pathlib

import pytest
import torch

from interp_engine import POINTS, TL_HOOKS, Address, from_tl, parse_address
from interp_engine._tl import TL_MODEL_HOOKS

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "transformerlens.md"


@pytest.mark.parametrize("name, want", [
    ("blocks.3.hook_resid_post", Address("resid_post", 3)),
    ("blocks.0.hook_resid_pre", Address("resid_pre", 0)),
    ("blocks.11.hook_resid_mid", Address("resid_mid", 11)),
    ("blocks.2.attn.hook_z", Address("z", 2)),
    ("blocks.2.attn.hook_pattern", Address("pattern", 2)),
    ("blocks.1.mlp.hook_pre", Address("mlp_pre", 1)),
    ("blocks.1.mlp.hook_post", Address("mlp_act", 1)),
])
def test_hooks_with_a_counterpart(name, want):
    assert from_tl(name) == want


def test_every_table_entry_maps_to_a_point_or_says_why_not():
    for hook, (point, why) in TL_HOOKS.items():
        name = f"blocks.4.{hook}"
        if point:
            assert point in POINTS and from_tl(name) == Address(point, 4)
        else:
            assert why
            with pytest.raises(ValueError, match="no interp_engine point") as info:
                from_tl(name)
            assert why in str(info.value)
    for name, why in TL_MODEL_HOOKS.items():
        with pytest.raises(ValueError, match="no interp_engine point"):
            from_tl(name)


def test_bad_names_are_refused_clearly():
    with pytest.raises(ValueError, match=r"unknown TransformerLens hook name 'blocks\.1\.hook_nope'.*hook_resid_post"):
        from_tl("blocks.1.hook_nope")
    with pytest.raises(TypeError, match="from_tl takes"):
        from_tl(3)
    with pytest.raises(ValueError, match=r"TransformerLens hook name; use interp_engine\.from_tl"):
        parse_address("blocks.3.hook_resid_post")


def test_the_docs_table_lists_every_hook():
    text = DOC.read_text()
    for hook in list(TL_HOOKS) + list(TL_MODEL_HOOKS):
        assert f"`{hook}`" in text, hook


@pytest.mark.parametrize("arch", ["gpt2", "gemma2"])
def test_to_str_tokens_is_each_tokens_text_as_transformerlens_gives_it(eager_models, tiny_dirs, arch):
    """A string is tokenized as the tokenizer does (Gemma's BOS included) and each id decoded on
    its own; ids as a list, a 1-D or a [1, pos] tensor give the same; a list of strings gives a
    list per string (TransformerLens); a batch of several id rows is refused by name."""
    from transformers import AutoTokenizer

    model = eager_models[arch]
    tok = AutoTokenizer.from_pretrained(tiny_dirs[arch])
    text = "The capital of France is"
    ids = tok(text)["input_ids"]
    want = [tok.decode([i]) for i in ids]
    assert model.to_str_tokens(text) == want
    assert (want[0] == "<bos>") == (arch == "gemma2")
    for form in (ids, torch.tensor(ids), torch.tensor([ids])):
        assert model.to_str_tokens(form) == want
    other = "Paris"
    assert model.to_str_tokens([text, other]) == [want, [tok.decode([i]) for i in tok(other)["input_ids"]]]
    with pytest.raises(ValueError, match="one prompt, got a batch of 2"):
        model.to_str_tokens(torch.tensor([ids, ids]))
