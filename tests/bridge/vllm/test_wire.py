"""Plans and captures as plain data (no engine): what the client sends is what the worker reads,
a bad plan is refused naming what to send instead, and tensors survive the wire bit for bit."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")

from interp_engine import Address, Plan, SteerSpec, capture_plan, steer_plan  # noqa: E402
from interp_engine.testing import tiny_config  # noqa: E402
from specs import spec_for_config  # noqa: E402

D = 128


@pytest.fixture(scope="module")
def graph():
    config = tiny_config("qwen3")
    return spec_for_config(config).graph_from_config(config)


def _wire():
    from bridge.vllm import wire
    return wire


def test_a_plan_round_trips_through_plain_data(graph):
    wire = _wire()
    v = torch.randn(D)
    u = torch.randn(2, D)
    spec = (SteerSpec.add("resid_post.1", v, scale=2.5, positions="prompt")
            | SteerSpec.ablate("resid_mid.0", v) | SteerSpec.set("resid_pre.2", u, positions=[3, 7]))
    plan = capture_plan(graph, ["z.1", "resid_post.2"]) | steer_plan(graph, spec)
    data = wire.plan_to_wire(plan, "rid-1")
    json.dumps(data)  # plain data only: it must serialise as JSON (and msgpack)
    back = wire.plan_from_args({wire.KEY: data}, graph=graph)
    assert back.rid == "rid-1" and back.reads == (Address("z", 1), Address("resid_post", 2))
    assert [op.address for op in back.writes] == [op.address for op in plan.writes]
    for got, op in zip(back.writes, plan.writes):
        assert got.op == op.op and got.positions == op.positions and got.per_position == op.per_position
        assert torch.equal(got.vector, op.effective())  # the worker's effective vector, bit for bit


def test_a_packed_plan_is_the_same_plan_and_bad_bytes_are_refused(graph, tmp_path):
    """What the client sends (``pack_plan``: the mapping as one MessagePack bytes value) decodes
    to the plan the mapping decodes to, sink, board and vectors included; bytes that hold no
    plan are refused naming what to send, and a packed plan that fails its checks fails them
    as the mapping would (its rid still found, so its client hears why)."""
    wire = _wire()
    plan = capture_plan(graph, ["resid_post.1", "z.2"]) | steer_plan(graph, SteerSpec.add("resid_post.0", torch.randn(D)))
    sink = {"path": str(tmp_path / "rows"), "positions": 5, "offsets": {"resid_post.1": 0, "z.2": 4096},
            "widths": {"resid_post.1": D, "z.2": D}}
    data = wire.plan_to_wire(plan, "rid-p", sink=sink, board={"path": str(tmp_path / "board"), "at": 3})
    packed = wire.pack_plan(data)
    assert isinstance(packed, bytes)
    plain, unpacked = (wire.plan_from_args({wire.KEY: d}, graph=graph) for d in (data, packed))
    assert (unpacked.rid, unpacked.reads, unpacked.sink, unpacked.board) == (plain.rid, plain.reads, plain.sink, plain.board)
    assert unpacked.sink.offsets == {"resid_post.1": 0, "z.2": 4096} and unpacked.board == (str(tmp_path / "board"), 3)
    for got, want in zip(unpacked.writes, plan.writes):
        assert got.address == want.address and torch.equal(got.vector, want.effective())
    assert wire.plan_from_args({wire.KEY: memoryview(bytearray(packed))}, graph=graph).reads == plain.reads
    for bad, match in ((b"\xc1", "not a MessagePack plan"), (wire.pack_plan([1, 2]), "unpack to list")):
        with pytest.raises(wire.PlanError, match=match):
            wire.plan_from_args({wire.KEY: bad}, graph=graph)
        assert wire.plan_rid({wire.KEY: bad}, "req-9") == "req-9"
    data["writes"][0]["op"] = "multiply"
    with pytest.raises(wire.PlanError, match="unknown op 'multiply'"):
        wire.plan_from_args({wire.KEY: wire.pack_plan(data)}, graph=graph)
    assert wire.plan_rid({wire.KEY: wire.pack_plan(data)}, "req-9") == "rid-p" == wire.plan_rid({wire.KEY: data}, "x")


def _as_list(entry: dict, vector: list) -> None:
    """The write's vector sent as a list of floats (what a server request sends) instead."""
    entry.pop("vector_b64"), entry.pop("shape")
    entry["vector"] = vector


def test_a_vector_sent_as_a_list_of_floats_equals_the_same_sent_as_bytes(graph):
    wire = _wire()
    u = torch.randn(2, D)
    plan = steer_plan(graph, SteerSpec.set("resid_pre.2", u, positions=[3, 7]))
    data = wire.plan_to_wire(plan, "r")
    as_bytes = wire.plan_from_args({wire.KEY: data}, graph=graph)
    _as_list(data["writes"][0], u.to(torch.float64).tolist())
    as_list = wire.plan_from_args({wire.KEY: data}, graph=graph)
    assert torch.equal(as_bytes.writes[0].vector, as_list.writes[0].vector)
    assert torch.equal(as_bytes.writes[0].vector, plan.writes[0].effective())


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d["writes"][0].update(at="resid_post.9"), r"layer 9 out of range"),
    (lambda d: _as_list(d["writes"][0], [0.0] * 64), r"width 64; this model's d_model is 128"),
    (lambda d: d["writes"][0].update(vector=[0.0] * D), r"not both 'vector' and 'vector_b64'"),
    (lambda d: d["writes"][0].update(shape=[64]), r"holds 1024 bytes; shape \[64\] in float64 is 512"),
    (lambda d: d["writes"][0].update(vector_b64="not base64!"), r"must be base64"),
    (lambda d: d["writes"][0].pop("shape"), r"needs 'shape'"),
    (lambda d: d["writes"][0].update(op="multiply"), r"unknown op 'multiply'"),
    (lambda d: d["writes"][0].update(at="pattern.1"), r"pattern.1 is not a steering site"),
    (lambda d: d["writes"][0].update(at="mlp_act.1"), r"rows at mlp_act are 256 wide"),
    (lambda d: d["writes"][0].update(columns=[0, 128]), r"columns at resid_post.1 reach 128"),
    (lambda d: d["writes"][0].update(op="zero"), r"zero takes no vector"),
    (lambda d: d["writes"][0].update(scale=float("nan")), r"scale nan must be a finite number"),
    (lambda d: d["reads"].append("nope.1"), r"'nope.1' is not a point address"),
    (lambda d: d["reads"].append("resid_post.7"), r"layer 7 out of range"),
    (lambda d: d["writes"][0].update(positions=[-1]), r"non-negative"),
    (lambda d: d.update(v=99), r"v=1"),
])
def test_a_bad_plan_is_refused_with_what_to_send_instead(graph, mutate, match):
    wire = _wire()
    plan = capture_plan(graph, ["resid_post.1"]) | steer_plan(graph, SteerSpec.add("resid_post.1", torch.randn(D)))
    data = wire.plan_to_wire(plan, "r")
    mutate(data)
    with pytest.raises(wire.PlanError, match=match):
        wire.plan_from_args({wire.KEY: data}, graph=graph)


def test_an_expert_write_crosses_as_plain_data_and_a_bad_one_is_refused():
    wire = _wire()
    config = tiny_config("qwen3_moe")
    moe = spec_for_config(config).graph_from_config(config)
    layer = moe.moe_layers[0]
    plan = steer_plan(moe, SteerSpec.scale(f"mlp_out.{layer}", 0.5, positions="generated", experts=[3, 1]))
    data = wire.plan_to_wire(plan, "r")
    json.dumps(data)
    back = wire.plan_from_args({wire.KEY: data}, graph=moe).writes[0]
    assert (back.experts, back.op, back.scale, back.positions) == ((3, 1), "scale", 0.5, "generated")
    dense = [i for i in range(moe.n_layers) if i not in moe.moe_layers]
    bad = [({"experts": [moe.n_experts]}, rf"reach {moe.n_experts}; the router has {moe.n_experts} experts"),
           ({"experts": [1, 1]}, "repeats"), ({"experts": []}, "non-empty list"), ({"experts": [True]}, "non-negative"),
           ({"at": f"resid_post.{layer}"}, "zero or scale at an MoE layer's mlp_out"),
           ({"op": "add", "vector": [0.0] * moe.d_model}, "zero or scale")]
    if dense:
        bad.append(({"at": f"mlp_out.{dense[0]}"}, "not an MoE layer"))
    for change, match in bad:
        data = wire.plan_to_wire(plan, "r")
        data["writes"][0].update(change)
        with pytest.raises(wire.PlanError, match=match):
            wire.plan_from_args({wire.KEY: data}, graph=moe)


def test_a_harvest_sink_crosses_as_plain_data_and_a_bad_one_is_refused(graph, tmp_path):
    """A harvest request names the file its rows go to (the workers write them there)."""
    wire = _wire()
    plan = capture_plan(graph, ["resid_post.1", "z.0"])
    sink = {"path": str(tmp_path / "rows"), "offsets": {"resid_post.1": 0, "z.0": 4096}, "positions": 8}
    data = wire.plan_to_wire(plan, "r", sink=sink)
    json.dumps(data)
    back = wire.plan_from_args({wire.KEY: data}, graph=graph).sink
    assert (back.path, dict(back.offsets), back.positions) == (sink["path"], sink["offsets"], 8)
    assert wire.plan_from_args({wire.KEY: wire.plan_to_wire(plan, "r")}, graph=graph).sink is None
    for change, match in ((dict(path="rows"), r"absolute file path"),
                          (dict(positions=0), r"positions must be an int >= 1, got 0"),
                          (dict(offsets={"resid_post.1": 0}), r"map each read \(resid_post.1, z.0\)"),
                          (dict(offsets={"resid_post.1": 0, "z.0": -4}), r"byte offset >= 0"),
                          (dict(widths={"resid_post.1": 8}), r"widths must map each read"),
                          (dict(widths={"resid_post.1": 8, "z.0": 0}), r"floats per row \(an int >= 1\)"),
                          (dict(hold=1), r"hold must be true or false, got 1")):
        bad = dict(data, sink=dict(data["sink"], **change))
        with pytest.raises(wire.PlanError, match=match):
            wire.plan_from_args({wire.KEY: bad}, graph=graph)
    assert back.widths is None  # harvest's own sinks name none
    sized = wire.plan_from_args({wire.KEY: wire.plan_to_wire(plan, "r", sink=dict(
        sink, widths={"resid_post.1": 64, "z.0": 64}))}, graph=graph).sink
    assert dict(sized.widths) == {"resid_post.1": 64, "z.0": 64}
    assert not sized.hold and not back.hold  # rows go in as they are read, unless asked to be held
    held = wire.plan_to_wire(plan, "r", sink=dict(sink, hold=True))
    assert held["sink"]["hold"] is True and wire.plan_from_args({wire.KEY: held}, graph=graph).sink.hold


def test_a_status_board_crosses_only_with_a_plan_that_only_writes_or_sinks_its_rows(graph, tmp_path):
    wire = _wire()
    steer_only = steer_plan(graph, SteerSpec.add("resid_post.1", torch.randn(D)))
    board = {"path": str(tmp_path / "board"), "at": 12}
    data = wire.plan_to_wire(steer_only, "r", board=board)
    json.dumps(data)
    assert wire.plan_from_args({wire.KEY: data}, graph=graph).board == (board["path"], 12)
    assert wire.plan_from_args({wire.KEY: wire.plan_to_wire(steer_only, "r")}, graph=graph).board is None
    for change, match in ((dict(path="board"), r"absolute file path"), (dict(at=-1), r"byte offset >= 0"),
                          (dict(at=True), r"byte offset >= 0")):
        with pytest.raises(wire.PlanError, match=match):
            wire.plan_from_args({wire.KEY: dict(data, board=dict(board, **change))}, graph=graph)
    reading = wire.plan_to_wire(capture_plan(graph, ["resid_post.1"]) | steer_only, "r", board=board)
    with pytest.raises(wire.PlanError, match=r"only for plans that only write"):
        wire.plan_from_args({wire.KEY: reading}, graph=graph)
    sink = {"path": str(tmp_path / "rows"), "offsets": {"resid_post.1": 0}, "positions": 4}
    harvesting = wire.plan_to_wire(capture_plan(graph, ["resid_post.1"]), "r", sink=sink, board=board)
    assert wire.plan_from_args({wire.KEY: harvesting}, graph=graph).board == (board["path"], 12)


def test_a_write_many_requests_send_is_decoded_once_and_only_when_it_is_the_same(graph):
    wire = _wire()
    v = torch.randn(D)
    memo: dict = {}

    def ops(spec, rid):
        data = json.loads(json.dumps(wire.plan_to_wire(steer_plan(graph, spec), rid)))  # as a worker gets it
        return wire.plan_from_args({wire.KEY: data}, graph=graph, memo=memo).writes

    first = ops(SteerSpec.add("resid_post.1", v, scale=2.0), "a")
    assert ops(SteerSpec.add("resid_post.1", v, scale=2.0), "b") == first and len(memo) == 1
    assert ops(SteerSpec.add("resid_post.1", v, scale=2.0), "c")[0] is first[0]
    # any other content is another op: scale, site, positions, op, vector
    for other in (SteerSpec.add("resid_post.1", v, scale=3.0), SteerSpec.add("resid_post.2", v, scale=2.0),
                  SteerSpec.add("resid_post.1", v, scale=2.0, positions="prompt"),
                  SteerSpec.set("resid_post.1", v), SteerSpec.add("resid_post.1", v * 2, scale=2.0)):
        got = ops(other, "d")[0]
        expected = wire.plan_from_args({wire.KEY: wire.plan_to_wire(steer_plan(graph, other), "d")}, graph=graph)
        assert got is not first[0] and got.address == expected.writes[0].address
        assert got.positions == expected.writes[0].positions and got.op == expected.writes[0].op
        assert torch.equal(got.vector, expected.writes[0].vector)
    assert len(memo) == 6
    # a bad write is refused every time, never remembered
    bad = dict(wire.plan_to_wire(steer_plan(graph, SteerSpec.add("resid_post.1", v)), "e"))
    bad["writes"] = [dict(bad["writes"][0], scale=float("nan"))]
    for _ in range(2):
        with pytest.raises(wire.PlanError, match=r"finite"):
            wire.plan_from_args({wire.KEY: bad}, graph=graph, memo=memo)
    assert len(memo) == 6
    # nor is one equal to a remembered one only as Python compares numbers (True == 1, 1 == 1.0)
    one = dict(bad, writes=[dict(bad["writes"][0], scale=1)])
    wire.plan_from_args({wire.KEY: one}, graph=graph, memo=memo)
    with pytest.raises(wire.PlanError, match=r"finite"):
        wire.plan_from_args({wire.KEY: dict(bad, writes=[dict(bad["writes"][0], scale=True)])}, graph=graph, memo=memo)


def test_the_points_many_requests_read_are_decoded_once(graph):
    wire = _wire()
    memo: dict = {}

    def reads(points, rid):
        data = json.loads(json.dumps(wire.plan_to_wire(capture_plan(graph, points), rid)))
        return wire.plan_from_args({wire.KEY: data}, graph=graph, memo=memo).reads

    first = reads(["resid_post.1", "mlp_out.0"], "a")
    assert first == (Address("resid_post", 1), Address("mlp_out", 0))
    assert reads(["resid_post.1", "mlp_out.0"], "b") is first and len(memo) == 1
    assert reads(["mlp_out.0"], "c") == (Address("mlp_out", 0),) and len(memo) == 2
    # a point the graph lacks is refused every time, never remembered
    bad = dict(wire.plan_to_wire(capture_plan(graph, ["resid_post.1"]), "d"), reads=["resid_post.9"])
    for _ in range(2):
        with pytest.raises(wire.PlanError, match=r"resid_post\.9"):
            wire.plan_from_args({wire.KEY: bad}, graph=graph, memo=memo)
    assert len(memo) == 2
    # nor does a list decoded without a graph stand in for one checked against it
    assert wire.plan_from_args({wire.KEY: bad}, graph=None, memo={}).reads == (Address("resid_post", 9),)


def test_server_style_flat_arguments(graph, tmp_path):
    wire = _wire()
    v = torch.randn(D)
    path = tmp_path / "vectors.safetensors"
    wire.VectorRegistry.save(path, {"happy": v, "nowhere": torch.randn(D)}, {"happy": "resid_post.1"})
    registry = wire.VectorRegistry.load(path)
    plan = wire.plan_from_args({"interp_steer": "happy", "interp_scale": 3.0,
                                "interp_capture": "resid_post.0, mlp_out.2",
                                "interp_capture_path": "/tmp/x.safetensors"}, graph=graph, registry=registry)
    assert plan.rid == "/tmp/x.safetensors" and plan.reads == (Address("resid_post", 0), Address("mlp_out", 2))
    assert plan.writes[0].address == Address("resid_post", 1) and torch.equal(plan.writes[0].vector, v * 3.0)
    for args, match in (({"interp_steer": "sad"}, r"unknown vector name 'sad'; registered vectors: happy, nowhere"),
                        ({"interp_steer": "nowhere"}, r"no registered point: send 'interp_at'"),
                        ({"interp_scale": 2.0}, r"only with interp_steer"),
                        ({"interp_capture": ["resid_post.0"]}, r"needs interp_capture_path"),
                        ({"interp_steer": "happy", "interp_colour": 1}, r"unknown keys \['interp_colour'\]")):
        with pytest.raises(wire.PlanError, match=match):
            wire.plan_from_args(args, graph=graph, registry=registry)
    assert wire.plan_from_args({"other": 1}, graph=graph) is None and wire.plan_from_args(None) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensors_cross_the_wire_bit_for_bit(dtype):
    wire = _wire()
    t = torch.randn(5, 3, 32).to(dtype)
    back = wire.tensor_from_wire(wire.tensor_to_wire(t))
    assert back.dtype == dtype and torch.equal(back, t)
    back.add_(1)  # the copy is writable and its own
    assert not torch.equal(back, t)


def test_the_validator_passes_plans_its_process_issued_once_and_parses_every_other(graph):
    """A plan the client built from a checked Plan (``issue``) is not parsed again in the same
    process, once; any other plan (a server's request, a second use of the rid) is."""
    from types import SimpleNamespace

    from bridge.vllm import validator

    wire = _wire()
    data = wire.plan_to_wire(steer_plan(graph, SteerSpec.add("resid_post.1", torch.randn(D))), "mine-1")
    data["writes"][0]["op"] = "multiply"  # broken after the check: only a parse would see it
    params = SimpleNamespace(extra_args={wire.KEY: data})
    with pytest.raises(wire.PlanError, match="unknown op 'multiply'"):
        validator.PlanValidator.validate_params(params)
    validator.issue("mine-1")
    validator.PlanValidator.validate_params(params)  # issued here: passed as built
    with pytest.raises(wire.PlanError, match="unknown op 'multiply'"):
        validator.PlanValidator.validate_params(params)  # once only
    # packed (what the client sends): passed only as the very bytes object issued, once
    packed = wire.pack_plan(data)
    same = wire.pack_plan(data)
    packed_params = SimpleNamespace(extra_args={wire.KEY: packed})
    validator.issue(packed)
    with pytest.raises(wire.PlanError, match="unknown op 'multiply'"):
        validator.PlanValidator.validate_params(SimpleNamespace(extra_args={wire.KEY: same}))  # equal, not it
    validator.PlanValidator.validate_params(packed_params)
    with pytest.raises(wire.PlanError, match="unknown op 'multiply'"):
        validator.PlanValidator.validate_params(packed_params)
    data["writes"][0]["op"] = "add"
    validator.PlanValidator.validate_params(SimpleNamespace(extra_args={wire.KEY: wire.pack_plan(data)}))
    with pytest.raises(wire.PlanError, match="not a MessagePack plan"):
        validator.PlanValidator.validate_params(SimpleNamespace(extra_args={wire.KEY: b"\xc1"}))


def test_a_steering_op_is_encoded_once_and_each_request_gets_its_own_copy(graph):
    """Requests steering with one SteerSpec share its ops: the client encodes each op once, but
    hands every request an entry of its own, and never one of another op."""
    wire = _wire()
    plan = steer_plan(graph, SteerSpec.add("resid_post.1", torch.randn(D)))
    a, b = wire.plan_to_wire(plan, "a"), wire.plan_to_wire(plan, "b")
    assert a["writes"][0] == b["writes"][0] and a["writes"][0] is not b["writes"][0]
    a["writes"][0]["op"] = "multiply"
    assert wire.plan_to_wire(plan, "c")["writes"][0]["op"] == "add"
    other = steer_plan(graph, SteerSpec.add("resid_post.1", torch.randn(D)))  # same site, another vector
    got = wire.plan_from_args({wire.KEY: wire.plan_to_wire(other, "d")}, graph=graph).writes[0]
    assert torch.equal(got.vector, other.writes[0].flat_vector.to(got.vector.dtype))
