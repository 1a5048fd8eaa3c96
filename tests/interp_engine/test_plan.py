"""SteerSpec validation, composition, and the purity of the plan transforms (they read the
graph and the spec, return new data, and never change either)."""

from __future__ import annotations

import pytest
import torch

from interp_engine import Address, Plan, SteerOp, SteerSpec, capture_plan, steer_plan
from interp_engine.testing import tiny_config
from specs import spec_for_config

D = 128  # d_model of every tiny model


@pytest.fixture(scope="module")
def graph():
    config = tiny_config("qwen3")
    return spec_for_config(config).graph_from_config(config)


@pytest.fixture(scope="module")
def ds_graph():
    config = tiny_config("deepseek_v4")
    return spec_for_config(config).graph_from_config(config)


# ---- SteerSpec construction ----------------------------------------------------------

def test_builders_make_one_op_each():
    v = torch.randn(D)
    for spec, op in ((SteerSpec.add("resid_post.1", v, 2.0), "add"),
                     (SteerSpec.ablate("resid_post.1", v), "ablate"),
                     (SteerSpec.set("resid_post.1", v, positions=[4]), "set")):
        assert len(spec) == 1 and bool(spec)
        assert spec.ops[0].op == op and spec.ops[0].address == Address("resid_post", 1)
    assert SteerSpec.add(("mlp_out", 0), v).ops[0].address == Address("mlp_out", 0)
    assert SteerSpec.add(Address("mlp_out", 0), v).ops[0].scale == 1.0
    assert not SteerSpec()


def test_effective_vectors():
    v = torch.tensor([3.0, 4.0] + [0.0] * (D - 2))
    torch.testing.assert_close(SteerSpec.add("resid_post.0", v, 2.5).ops[0].effective(), v * 2.5)
    unit = SteerSpec.ablate("resid_post.0", v).ops[0].effective()
    torch.testing.assert_close(unit, v / 5.0)
    set_op = SteerSpec.set("resid_post.0", v).ops[0]
    assert set_op.effective() is not v and torch.equal(set_op.effective(), v)


@pytest.mark.parametrize("positions, expected", [
    ("all", "all"), ("prompt", "prompt"), ("generated", "generated"),
    ([4], (4,)), ((0, 2, 5), (0, 2, 5)), (range(3), (0, 1, 2)), (torch.tensor([1, 3]), (1, 3)),
])
def test_positions_normalised(positions, expected):
    assert SteerSpec.add("resid_post.0", torch.randn(D), positions=positions).ops[0].positions == expected


@pytest.mark.parametrize("positions, match", [
    ("some", "positions='some'"), ([], "empty"), ([-1], "non-negative"), ([1.5], "non-negative"),
    ([True], "non-negative"), ([2, 2], "repeats"), (3, "positions must be"),
])
def test_bad_positions(positions, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SteerSpec.add("resid_post.0", torch.randn(D), positions=positions)


@pytest.mark.parametrize("build, error, match", [
    (lambda: SteerSpec.add("resid_post.0", [0.0] * D), TypeError, "torch.Tensor"),
    (lambda: SteerSpec.add("resid_post.0", torch.ones(D, dtype=torch.long)), TypeError, "floating"),
    (lambda: SteerSpec.add("resid_post.0", torch.randn(2, 3, D)), ValueError, r"shape \(2, 3, 128\)"),
    (lambda: SteerSpec.add("resid_post.0", torch.randn(2, D)), ValueError, "per-position"),
    (lambda: SteerSpec.add("resid_post.0", torch.randn(2, D), positions=[1, 2, 3]), ValueError,
     "sequence of 2"),
    (lambda: SteerSpec.ablate("resid_post.0", torch.zeros(D)), ValueError, "zero"),
    (lambda: SteerSpec.ablate("resid_post.0", torch.randn(2, D), positions=[0, 1]), ValueError,
     "one direction"),
    (lambda: SteerSpec.add("resid_post.0", torch.randn(D), scale=True), TypeError, "scale"),
    (lambda: SteerSpec.add("resid_post.0", torch.randn(D), scale="2"), TypeError, "scale"),
    (lambda: SteerSpec.add("resid_post.0", torch.full((D,), float("nan"))), ValueError, "non-finite"),
    (lambda: SteerSpec.add("resid_post.0", torch.full((D,), float("inf"))), ValueError, "non-finite"),
    (lambda: SteerSpec.add("nope.0", torch.randn(D)), ValueError, "'nope'"),
    (lambda: SteerOp(Address("resid_post", 0), "multiply", torch.randn(D)), ValueError, "multiply"),
])
def test_bad_specs_raise_at_construction(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_messages_name_the_site():
    with pytest.raises(TypeError, match="resid_mid.2"):
        SteerSpec.add("resid_mid.2", torch.ones(D, dtype=torch.int32))


# ---- composition ---------------------------------------------------------------------

def test_composition_keeps_order_and_is_associative():
    a = SteerSpec.add("resid_post.0", torch.randn(D))
    b = SteerSpec.ablate("resid_post.1", torch.randn(D))
    c = SteerSpec.set("mlp_out.2", torch.randn(D))
    ab = a | b
    assert ab.ops == a.ops + b.ops and (b | a).ops == b.ops + a.ops
    assert ((a | b) | c).ops == (a | (b | c)).ops
    assert (a | SteerSpec()).ops == a.ops
    assert ab.sites == (Address("resid_post", 0), Address("resid_post", 1))
    assert (a | a).sites == (Address("resid_post", 0),) and len(a | a) == 2
    with pytest.raises(TypeError):
        a | 3  # type: ignore[operator]
    # composing never changes the operands
    assert len(a) == 1 and len(b) == 1


def test_plan_union_dedups_reads_and_keeps_writes():
    r1 = Plan(reads=(Address("z", 0), Address("q", 1)))
    r2 = Plan(reads=(Address("q", 1), Address("k", 2)))
    w = Plan(writes=SteerSpec.add("resid_post.0", torch.randn(D)).ops)
    both = r1 | r2 | w
    assert both.reads == (Address("z", 0), Address("q", 1), Address("k", 2))
    assert both.writes == w.writes
    assert Plan().empty and not both.empty


# ---- transforms ----------------------------------------------------------------------

def test_capture_plan_forms(graph):
    assert capture_plan(graph, "resid_post.1").reads == (Address("resid_post", 1),)
    assert capture_plan(graph, ("resid_post", 1)).reads == (Address("resid_post", 1),)
    assert capture_plan(graph, Address("z", 2)).reads == (Address("z", 2),)
    plan = capture_plan(graph, ["resid_post.1", ("mlp_out", 0), Address("resid_post", 1)])
    assert plan.reads == (Address("resid_post", 1), Address("mlp_out", 0))
    assert plan.writes == ()


def test_capture_plan_is_checked_once_per_graph_and_points(graph):
    # a loop capturing the same points gets the same checked plan back; another graph (fewer
    # layers) or other points are checked afresh, never served a plan checked elsewhere
    first = capture_plan(graph, ["resid_post.2", "mlp_out.0"])
    assert capture_plan(graph, ["resid_post.2", "mlp_out.0"]) is first
    assert capture_plan(graph, ("resid_post.2", "mlp_out.0")) is first
    assert capture_plan(graph, ["mlp_out.0", "resid_post.2"]).reads == first.reads[::-1]
    config = tiny_config("qwen3")
    config.num_hidden_layers = 2
    small = spec_for_config(config).graph_from_config(config)
    with pytest.raises(ValueError, match=r"resid_post\.2"):
        capture_plan(small, ["resid_post.2", "mlp_out.0"])
    assert capture_plan(small, ["resid_post.1"]).reads == (Address("resid_post", 1),)
    with pytest.raises(ValueError, match=r"resid_post\.2"):  # a refused list is never remembered
        capture_plan(small, ["resid_post.2", "mlp_out.0"])


def test_a_plan_joined_with_nothing_is_itself(graph):
    plan = capture_plan(graph, ["resid_post.1"])
    steer = steer_plan(graph, SteerSpec.add("resid_post.1", torch.ones(D)))
    assert plan | Plan() is plan and Plan() | steer is steer
    both = plan | steer
    assert both.reads == plan.reads and both.writes == steer.writes


def test_capture_plan_checks_the_graph(graph):
    with pytest.raises(ValueError, match=r"resid_post\.3.*0\.\.2"):
        capture_plan(graph, ["resid_post.0", "resid_post.3"])
    with pytest.raises(ValueError, match="'resid_streams'"):
        capture_plan(graph, ["resid_streams.0"])


def test_steer_plan_is_checked_once_per_spec_graph_and_dtype(graph, ds_graph):
    spec = SteerSpec.add("resid_post.1", torch.ones(D))
    first = steer_plan(graph, spec, torch.float32)
    assert steer_plan(graph, spec, torch.float32) is first
    # the same spec against another dtype, or a graph where its site is not a steering site,
    # is checked afresh (and refused there), however often it passed here
    with pytest.raises(TypeError, match="dtype"):
        steer_plan(graph, spec, torch.bfloat16)
    with pytest.raises(ValueError, match="resid_post"):
        steer_plan(ds_graph, SteerSpec.add("resid_post.0", torch.ones(D)))
    wide = SteerSpec.add("resid_post.0", torch.ones(D))
    assert steer_plan(graph, wide).writes == wide.ops
    with pytest.raises(ValueError, match="resid_post"):
        steer_plan(ds_graph, wide)


def test_a_spec_joined_with_nothing_is_itself_and_keeps_its_checked_plan(graph):
    # a request with steer=spec and no steer block in force joins spec to the empty active
    # spec: it must get spec itself back, or every request would check spec's ops afresh
    spec = SteerSpec.add("resid_post.1", torch.ones(D))
    assert SteerSpec() | spec is spec and spec | SteerSpec() is spec
    assert steer_plan(graph, SteerSpec() | spec, torch.float32) is steer_plan(graph, spec, torch.float32)
    both = spec | SteerSpec.zero("resid_post.0")
    assert both.ops == spec.ops + SteerSpec.zero("resid_post.0").ops


def test_steer_plan_checks(graph, ds_graph):
    ok = SteerSpec.add("resid_post.1", torch.randn(D))
    assert steer_plan(graph, ok, torch.float32).writes == ok.ops
    assert steer_plan(graph, None).empty
    with pytest.raises(ValueError, match=r"width 64.*d_model=128"):
        steer_plan(graph, SteerSpec.add("resid_post.1", torch.randn(64)))
    with pytest.raises(TypeError, match=r"float64.*float32"):
        steer_plan(graph, SteerSpec.add("resid_post.1", torch.randn(D, dtype=torch.float64)),
                   torch.float32)
    with pytest.raises(ValueError, match=r"resid_post\.9"):
        steer_plan(graph, SteerSpec.add("resid_post.9", torch.randn(D)))
    with pytest.raises(ValueError, match=r"cannot steer at pattern\.0.*steerable points"):
        steer_plan(graph, SteerSpec.add("pattern.0", torch.randn(D)))
    with pytest.raises(ValueError, match="not a steering site"):
        steer_plan(ds_graph, SteerSpec.add("resid_post.0", torch.randn(D)))  # a 4-stream stack
    assert steer_plan(ds_graph, SteerSpec.add("mlp_out.0", torch.randn(D))).writes
    with pytest.raises(TypeError, match="SteerSpec"):
        steer_plan(graph, "resid_post.0")  # type: ignore[arg-type]


def test_transforms_are_pure(graph):
    before_graph = repr(graph), graph.points(), hash(graph.residual_basis)
    v = torch.randn(D)
    v_copy = v.clone()
    spec = SteerSpec.add("resid_post.1", v, 3.0) | SteerSpec.ablate("resid_post.2", v)
    ops_before = spec.ops
    points = ["resid_post.1", ("z", 0)]
    p1 = capture_plan(graph, points) | steer_plan(graph, spec, torch.float32)
    p2 = capture_plan(graph, points) | steer_plan(graph, spec, torch.float32)
    assert p1.reads == p2.reads and p1.writes == p2.writes
    assert points == ["resid_post.1", ("z", 0)]
    assert spec.ops is ops_before and torch.equal(v, v_copy)
    assert (repr(graph), graph.points(), hash(graph.residual_basis)) == before_graph
    assert all(w is o for w, o in zip(p1.writes, spec.ops))


def test_spec_and_plan_are_frozen():
    spec = SteerSpec.add("resid_post.0", torch.randn(D))
    with pytest.raises(AttributeError):
        spec.ops = ()  # type: ignore[misc]
    with pytest.raises(AttributeError):
        spec.ops[0].scale = 2.0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        Plan().reads = ()  # type: ignore[misc]


# ---- frozen, compared by content -------------------------------------------------------

def test_a_spec_holds_its_own_copy_of_the_vector():
    v = torch.randn(D)
    keep = v.clone()
    for spec in (SteerSpec.add("resid_post.0", v, 2.0), SteerSpec.set("resid_post.0", v),
                 SteerSpec.ablate("resid_post.0", v)):
        op = spec.ops[0]
        effective_before = op.effective().clone()
        v.mul_(-3.0).add_(1.0)  # the caller edits the tensor after building the spec
        assert torch.equal(op.vector, keep)
        assert torch.equal(op.effective(), effective_before)
        v.copy_(keep)
        op.vector.zero_()  # editing what .vector returns changes nothing either
        assert torch.equal(op.vector, keep)


def test_ops_and_specs_are_immutable():
    op = SteerSpec.add("resid_post.0", torch.randn(D)).ops[0]
    for name, value in (("scale", 5.0), ("op", "set"), ("vector", torch.zeros(D)), ("positions", "all")):
        with pytest.raises(AttributeError, match="immutable"):
            setattr(op, name, value)
    spec = SteerSpec((op,))
    with pytest.raises(AttributeError):
        spec.ops = ()  # type: ignore[misc]


def test_specs_and_plans_compare_and_hash_by_content():
    v = torch.randn(D)
    a = SteerSpec.add("resid_post.0", v, 2.0, positions=[1, 2])
    b = SteerSpec.add("resid_post.0", v.clone(), 2.0, positions=(1, 2))
    assert a == b and hash(a) == hash(b) and a.ops[0] == b.ops[0]
    assert a != SteerSpec.add("resid_post.0", v, 2.5, positions=[1, 2])
    assert a != SteerSpec.add("resid_post.0", v + 1e-6, 2.0, positions=[1, 2])
    assert a != SteerSpec.add("resid_post.1", v, 2.0, positions=[1, 2])
    assert a != SteerSpec.set("resid_post.0", v, positions=[1, 2])
    assert SteerSpec.add("resid_post.0", v) != SteerSpec.add("resid_post.0", v.double())
    assert len({a, b, a | b}) == 2
    assert Plan(writes=a.ops) == Plan(writes=b.ops) and hash(Plan(writes=a.ops)) == hash(Plan(writes=b.ops))
    assert Plan(reads=(Address("z", 0),)) == Plan(reads=(Address("z", 0),))
    import pickle

    assert pickle.loads(pickle.dumps(a)) == a


def test_gradients_reach_the_callers_vector_through_the_copy():
    v = torch.randn(D, requires_grad=True)
    op = SteerSpec.ablate("resid_post.0", v).ops[0]
    for _ in range(2):  # a fresh graph each time: backward twice works
        (op.effective() * torch.arange(D, dtype=torch.float32)).sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scales_are_refused(scale):
    with pytest.raises(ValueError, match=r"scale at resid_post.0 must be finite"):
        SteerSpec.add("resid_post.0", torch.randn(D), scale=scale)


def test_numpy_values_are_accepted_as_numbers():
    np = pytest.importorskip("numpy")
    op = SteerSpec.add("resid_post.0", torch.randn(D), scale=np.float32(2.0),
                       positions=[np.int64(3), np.int32(5)]).ops[0]
    assert op.positions == (3, 5) and all(type(p) is int for p in op.positions) and op.scale == 2.0
    assert SteerSpec.add("resid_post.0", torch.randn(D), positions=np.array([1, 4])).ops[0].positions == (1, 4)
    with pytest.raises(ValueError, match="non-negative ints"):
        SteerSpec.add("resid_post.0", torch.randn(D), positions=[np.float64(1.0)])
