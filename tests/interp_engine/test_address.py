"""Addresses: frozen, hashable names of points; string round-trip; errors that quote the input
and list what is valid; layer ranges checked against a model graph."""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from interp_engine import POINTS, Address, format_address, parse_address, to_address

PER_STREAM = sorted(n for n, p in POINTS.items() if p.per_stream)
PLAIN = sorted(n for n, p in POINTS.items() if not p.per_stream)


def test_frozen_and_hashable():
    a = Address("resid_post", 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.layer = 4  # type: ignore[misc]
    assert hash(a) == hash(Address("resid_post", 3))
    assert {a: 1}[Address("resid_post", 3)] == 1
    assert len({a, Address("resid_post", 3), Address("resid_post", 4)}) == 2
    assert Address("resid_streams", 1, 2) != Address("resid_streams", 1)


def test_an_address_pickled_in_one_process_is_found_by_its_content_in_another():
    # each address keeps its hash once computed; a str's hash differs between processes, so a
    # pickle that carried it would file the address under a stale hash in a dict rebuilt there
    a = Address("resid_post", 3)
    assert hash(a) == hash(Address("resid_post", 3)) and str(a) == "resid_post.3"
    blob = pickle.dumps({a: 1, Address("z", 0): 2})
    probe = ("import pickle, sys; from interp_engine import Address; "
             "d = pickle.loads(sys.stdin.buffer.read()); "
             "print(d[Address('resid_post', 3)], d[Address('z', 0)], Address('z', 0) in set(d))")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", probe], input=blob, capture_output=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert out.stdout.split() == [b"1", b"2", b"True"]


@pytest.mark.parametrize("text, expected", [
    ("resid_post.10", Address("resid_post", 10)),
    ("z.7", Address("z", 7)),
    ("mlp_out.0", Address("mlp_out", 0)),
    ("resid_streams.5.2", Address("resid_streams", 5, 2)),
    ("resid_streams.5", Address("resid_streams", 5)),
])
def test_parse_format_examples(text, expected):
    assert parse_address(text) == expected
    assert format_address(expected) == text
    assert str(expected) == text


@given(name=st.sampled_from(PLAIN), layer=st.integers(0, 10_000))
def test_round_trip_plain(name, layer):
    a = Address(name, layer)
    assert parse_address(format_address(a)) == a
    assert to_address(format_address(a)) == a
    assert to_address((name, layer)) == a


@given(name=st.sampled_from(PER_STREAM), layer=st.integers(0, 1000),
       stream=st.one_of(st.none(), st.integers(0, 64)))
def test_round_trip_streams(name, layer, stream):
    a = Address(name, layer, stream)
    assert parse_address(format_address(a)) == a
    assert to_address(format_address(a)) == a
    assert to_address((name, layer, stream) if stream is not None else (name, layer)) == a


def test_ordering_mixes_stacks_and_streams():
    items = [Address("resid_streams", 1, 2), Address("resid_post", 2), Address("resid_streams", 1),
             Address("resid_post", 0), Address("resid_streams", 0, 3)]
    assert sorted(items) == [Address("resid_post", 0), Address("resid_post", 2),
                             Address("resid_streams", 0, 3), Address("resid_streams", 1),
                             Address("resid_streams", 1, 2)]
    assert Address("z", 1) < Address("z", 2) <= Address("z", 2) and Address("z", 3) > Address("q", 9)
    with pytest.raises(TypeError):
        Address("z", 1) < "z.2"  # noqa: B015


def test_to_address_forms():
    a = Address("mlp_out", 3)
    assert to_address(a) is a
    assert to_address("mlp_out.3") == a
    assert to_address(("mlp_out", 3)) == a
    assert to_address(("resid_streams", 1, 0)) == Address("resid_streams", 1, 0)
    for bad in (3, 3.0, None, ["mlp_out", 3]):
        with pytest.raises(TypeError, match="Address"):
            to_address(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\('mlp_out',\)"):
        to_address(("mlp_out",))


@pytest.mark.parametrize("text", [
    "resid_post", "resid_post.", "resid_post.x", "resid_post.-1", ".3", "resid_post 3",
    "RESID_POST.3", "resid_post.1.2.3", "", "resid_post.01",
])
def test_bad_strings_quote_input(text):
    with pytest.raises(ValueError) as info:
        parse_address(text)
    message = str(info.value)
    assert repr(text) in message
    if text != "resid_post.01":
        assert "resid_post" in message and "mlp_out" in message  # lists the valid names


def test_parse_rejects_non_strings():
    with pytest.raises(TypeError, match="str"):
        parse_address(3)  # type: ignore[arg-type]


def test_unknown_names_list_valid_ones():
    with pytest.raises(ValueError) as info:
        parse_address("resid_postt.3")
    assert "'resid_postt'" in str(info.value)
    for name in POINTS:
        assert name in str(info.value)
    with pytest.raises(ValueError) as info:
        Address("residual", 3)
    assert "'residual'" in str(info.value) and "resid_pre" in str(info.value)


def test_negative_layers_and_bad_types():
    with pytest.raises(ValueError, match=r"-1.*count layers from 0"):
        Address("resid_post", -1)
    with pytest.raises(ValueError, match="-2"):
        to_address(("resid_post", -2))
    with pytest.raises(TypeError, match="int"):
        Address("resid_post", 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int"):
        Address("resid_post", True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stream"):
        Address("resid_post", 1, 0)  # only resid_streams takes a stream
    with pytest.raises(ValueError, match="-1"):
        Address("resid_streams", 1, -1)


def test_format_rejects_strings():
    with pytest.raises(TypeError):
        format_address("resid_post.1")  # type: ignore[arg-type]


# ---- against a model graph (config only, no forward) ----------------------------------

@pytest.fixture(scope="module")
def graphs():
    from interp_engine.testing import TINY_ARCHS, tiny_config
    from specs import spec_for_config

    out = {}
    for arch in TINY_ARCHS:
        config = tiny_config(arch)
        out[arch] = spec_for_config(config).graph_from_config(config)
    return out


def test_check_address_in_range(graphs):
    g = graphs["qwen3"]
    assert g.check_address("resid_post.2") == Address("resid_post", 2)
    assert g.check_address(("z", 0)) == Address("z", 0)
    assert graphs["deepseek_v4"].check_address("resid_streams.1.3") == Address("resid_streams", 1, 3)


def test_check_address_out_of_range_quotes_and_lists(graphs):
    g = graphs["qwen3"]
    with pytest.raises(ValueError) as info:
        g.check_address("resid_post.99")
    message = str(info.value)
    assert "resid_post.99" in message and "3 layers" in message and "0..2" in message
    with pytest.raises(ValueError) as info:
        g.check_address(Address("mlp_out", 3))
    assert "mlp_out.3" in str(info.value) and "0..2" in str(info.value)


def test_check_address_negative_via_graph(graphs):
    with pytest.raises(ValueError, match=r"'resid_post\.-1'"):
        graphs["llama"].check_address("resid_post.-1")
    with pytest.raises(ValueError, match="-1"):
        graphs["llama"].check_address(("resid_post", -1))


def test_check_address_point_not_on_model(graphs):
    with pytest.raises(ValueError) as info:
        graphs["qwen3"].check_address("resid_streams.1")
    message = str(info.value)
    assert "'resid_streams'" in message and "qwen3" in message and "resid_post" in message
    with pytest.raises(ValueError) as info:
        graphs["qwen3_moe"].check_address("mlp_act.0")
    message = str(info.value)
    assert "'mlp_act'" in message and "qwen3_moe" in message and "router_logits" in message
    with pytest.raises(ValueError) as info:
        graphs["qwen3"].check_address("router_logits.0")
    assert "'router_logits'" in str(info.value)


def test_check_address_stream_range(graphs):
    with pytest.raises(ValueError) as info:
        graphs["deepseek_v4"].check_address("resid_streams.1.4")
    message = str(info.value)
    assert "resid_streams.1.4" in message and "4 streams" in message and "0..3" in message


# ---- point patterns ------------------------------------------------------------------------

@pytest.mark.parametrize("stream_first", [True, False])
def test_shape_of_a_stream_drops_the_stream_axis_whichever_is_asked_first(graphs, stream_first):
    # shape_of keeps each point's sized dims once asked: the whole stack and one stream of it
    # are two entries (a fresh graph each time, so the order asked is the one tested)
    from dataclasses import replace

    graph = replace(graphs["deepseek_v4"])
    n = graph.residual_basis.n_streams
    assert n > 1
    whole, one = Address("resid_streams", 1), Address("resid_streams", 1, 0)
    for address in ((one, whole) if stream_first else (whole, one)):
        expected = (2, 5, n, graph.d_model) if address.stream is None else (2, 5, graph.d_model)
        assert graph.shape_of(address, 2, 5) == expected


def test_patterns_expand_to_the_models_addresses_in_run_with_cache(eager_models):
    import torch

    from interp_engine import run_with_cache

    model = eager_models["qwen3"]
    tokens = model.to_tokens("Hello there")
    cache = run_with_cache(model, tokens, "resid_post.*")
    assert [str(a) for a in cache] == [f"resid_post.{i}" for i in range(model.graph.n_layers)]
    at_one = run_with_cache(model, tokens, ["*.1", "resid_pre.0"])
    assert {a.layer for a in at_one} == {0, 1}
    assert {a.name for a in at_one if a.layer == 1} == {p.name for p in model.graph.points()
                                                       if 1 in model.graph.layers_of(p.name)}
    full = run_with_cache(model, tokens, ["resid_post.0", "resid_post.1"])
    torch.testing.assert_close(cache["resid_post.1"], full["resid_post.1"], rtol=0, atol=0)


def test_a_pattern_that_matches_nothing_is_refused(eager_models):
    import torch

    from interp_engine import run_with_cache

    model = eager_models["qwen3"]
    with pytest.raises(ValueError, match=r"pattern 'resid_post\.99\*' matches no point"):
        run_with_cache(model, model.to_tokens("Hi"), ["resid_post.99*"])
