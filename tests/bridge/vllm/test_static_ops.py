"""vllm-static's ops and row maps without an engine (fast, and the only place the fixed-shape
path that CUDA graphs replay runs in CI): ``StaticTaps.fill`` for concurrent requests with
padding rows between them, both op paths (``tap_rows`` / ``steer_rows`` on CPU, ``tap_fixed`` /
``steer_fixed`` on CUDA) against the op math written out here, rows leaving in ``drain``, maps
kept or rewritten as the batch changes, and a captured value surviving an in-place write to
its source (CUDA's fused add+RMSNorm). Runs on CUDA too where one is present
(``benchmarks/gpu_check.sh``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from bridge.vllm.static_ops import steer_fixed, steer_rows, tap_fixed, tap_rows
from bridge.vllm.static_taps import StaticTaps
from interp_engine import Address
from specs import SPECS

D, MAX_TOKENS = 8, 16
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
POST0, MLP1 = Address("resid_post", 0), Address("mlp_out", 1)


def _request(reads, writes, vectors, prompt_len):
    """A worker's request: each op's ``vector`` is its decoded vector (one object per content,
    as the wire memo makes it), ``vectors`` the request's copies on the model's device."""
    for op, vector in zip(writes, vectors):
        op.vector = vector
    plan = SimpleNamespace(reads=tuple(reads), writes=tuple(writes))
    return SimpleNamespace(plan=plan, vectors=vectors, prompt_len=prompt_len, error=None)


def _op(address, kind, positions="all", per_position=False, scale=1.0):
    return SimpleNamespace(address=address, op=kind, positions=positions, per_position=per_position, scale=scale,
                           experts=None)


def _taps(device, fixed):
    taps = StaticTaps(nn.Module(), SPECS["qwen3"], (POST0, MLP1), (POST0,), 4, MAX_TOKENS,
                      torch.device(device), torch.float32, D)
    taps.fixed = fixed
    return taps


def _run(taps, x, y, fixed):
    """Both ops of one step on copies of x: the steered x, and each tap's buffer."""
    x = x.clone()
    site = taps.sites[POST0]
    if fixed:
        steer_fixed(x, None, site.vec, site.direction, site.coef, site.slot_of)
    else:
        steer_rows(x, None, site.vec, site.direction, site.coef, site.rows, site.slots, site.count)
    for tap in taps.taps.values():
        if fixed:
            tap_fixed(x, y, tap.buf, tap.dest)
        else:
            tap_rows(x, y, tap.buf, tap.rows, tap.count)
    return x


def _each(put):
    """A drain callback (per tap) that hands each reader its rows: ``put(request, address,
    rows, s, e)``."""
    return lambda address, rows, readers: [put(r, address, rows[o:o + e - s], s, e) for r, s, e, o in readers]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fixed", [False, True], ids=["rows", "fixed"])
def test_concurrent_rows_steer_and_capture_exactly_what_each_request_asked(device, fixed):
    g = torch.Generator().manual_seed(0)
    v, u = torch.randn(D, generator=g), torch.randn(D, generator=g)
    u = u / u.norm()
    taps = _taps(device, fixed)
    a = _request([POST0], [_op(POST0, "add")], [v.to(device)], prompt_len=3)
    b = _request([POST0, MLP1], [_op(POST0, "ablate", positions="generated")], [u.to(device)], prompt_len=1)
    c = _request([], [_op(POST0, "set", positions=(4,))], [3 * v.to(device)], prompt_len=5)
    for request in (a, b, c):
        taps.admit(request)
    # rows 0-2: a's prompt; 3-4: padding; 5-7: b (positions 0-2, prompt 1); 8-9: c (positions 3-4)
    positions = torch.tensor([0, 1, 2, 7, 7, 0, 1, 2, 3, 4])
    active = [(a, 0, 3), (b, 5, 8), (c, 8, 10)]
    x = torch.randn(10, D, generator=g).to(device)
    for step in range(2):  # the second step keeps the same maps (nothing rewritten): same result
        taps.fill(active, positions)
        out = _run(taps, x, None, fixed)
        want = x.clone()
        want[0:3] = x[0:3] + v.to(device)
        want[6:8] = x[6:8] - (x[6:8] @ u.to(device))[:, None] * u.to(device)
        want[9] = 3 * v.to(device)
        assert torch.equal(out[:3], want[:3]) and torch.equal(out[3:6], x[3:6]) and torch.equal(out[8], x[8])
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6, msg=f"step {step}")
        got = {}
        taps.drain(_each(lambda request, address, rows, s, e: got.__setitem__((id(request), address), (rows, s, e))))
        assert set(got) == {(id(a), POST0), (id(b), POST0), (id(b), MLP1)}
        for (rid, address), (rows, s, e) in got.items():
            assert rows.device.type == "cpu" and torch.equal(rows, out[s:e].cpu()), (address, s, e)
    # the batch changes: only b, at other rows; then nothing at all
    taps.fill([(b, 0, 2)], torch.tensor([3, 4]))
    out = _run(taps, x[:2], None, fixed)
    torch.testing.assert_close(out, x[:2] - (x[:2] @ u.to(device))[:, None] * u.to(device), atol=1e-6, rtol=1e-6)
    got = {}
    taps.drain(_each(lambda request, address, rows, s, e: got.__setitem__(address, rows)))
    assert set(got) == {POST0, MLP1} and torch.equal(got[MLP1], out.cpu())
    # only a, which adds: the site takes its slice-add path, exactly x + v
    taps.fill([(a, 2, 5)], torch.tensor([3, 4, 5]))
    assert fixed or taps.sites[POST0].count.tolist()[:2] == [3, 2]
    out = _run(taps, x[:6], None, fixed)
    assert torch.equal(out[2:5], x[2:5] + v.to(device)) and torch.equal(out[:2], x[:2])
    assert torch.equal(out[5:], x[5:6])
    taps.drain(_each(lambda *_: None))
    # two requests that add, each its own vector: one index_add_, exactly x + each one's v
    d = _request([], [_op(POST0, "add", positions=(2,))], [-2 * v.to(device)], prompt_len=1)
    taps.admit(d)
    taps.fill([(a, 0, 2), (d, 3, 6)], torch.tensor([6, 7, 9, 0, 1, 2]))
    assert fixed or taps.sites[POST0].count.tolist()[:2] == [3, 1]
    out = _run(taps, x[:6], None, fixed)
    assert torch.equal(out[:2], x[:2] + v.to(device)) and torch.equal(out[5], x[5] - 2 * v.to(device))
    assert torch.equal(out[2:5], x[2:5])
    taps.drain(_each(lambda *_: None))
    taps.forget(d)
    # two requests side by side, each adding its own vector: the gathered vectors added to their
    # one span of rows at once, exactly x + each one's v
    f = _request([], [_op(POST0, "add")], [-2 * v.to(device)], prompt_len=1)
    taps.admit(f)
    taps.fill([(a, 1, 3), (f, 3, 6)], torch.tensor([0, 6, 7, 0, 1, 2]))  # row 0: padding
    assert fixed or taps.sites[POST0].count.tolist()[:3] == [5, 3, 1]
    out = _run(taps, x[:6], None, fixed)
    assert torch.equal(out[1:3], x[1:3] + v.to(device)) and torch.equal(out[3:6], x[3:6] - 2 * v.to(device))
    assert torch.equal(out[0], x[0])
    taps.drain(_each(lambda *_: None))
    taps.forget(f)
    taps.fill([], None)
    assert taps.idle and all(int(t.count[0]) == 0 for t in taps.taps.values())
    assert int(taps.sites[POST0].count[0]) == 0
    if fixed:  # every row maps to the sink and to the identity slot again
        assert all(bool((t.dest == MAX_TOKENS).all()) for t in taps.taps.values())
        assert not bool(taps.sites[POST0].slot_of.any())
    assert torch.equal(_run(taps, x, None, fixed), x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fixed", [False, True], ids=["rows", "fixed"])
def test_a_capture_survives_an_in_place_write_to_its_source(device, fixed):
    """The tap copies inside the op: a later in-place kernel on the same tensor (vLLM's CUDA
    fused add+RMSNorm rewrites the residual it is given) leaves the capture as it was."""
    taps = _taps(device, fixed)
    request = _request([POST0], [], [], prompt_len=4)
    taps.admit(request)
    taps.fill([(request, 0, 4)], torch.arange(4))
    h, r = torch.randn(4, D).to(device), torch.randn(4, D).to(device)
    want = (h + r).cpu()
    tap = taps.taps[POST0]
    (tap_fixed(h, r, tap.buf, tap.dest) if fixed else tap_rows(h, r, tap.buf, tap.rows, tap.count))
    r.mul_(0.5).add_(h)  # what fused_add_rms_norm does to its residual argument
    h.zero_()
    got = {}
    taps.drain(_each(lambda req, address, rows, s, e: got.__setitem__(address, rows)))
    assert torch.equal(got[POST0], want)


def test_a_worker_refuses_two_writes_at_one_site_in_one_request():
    """The client refuses this before any forward; a plan from elsewhere (a server request)
    fails at admission rather than reach a site whose rows take one slot each, which would drop
    the first op without a word."""
    taps = _taps("cpu", False)
    v = torch.ones(D)
    request = _request([], [_op(POST0, "add"), _op(POST0, "add")], [v, 2 * v], prompt_len=2)
    with pytest.raises(ValueError, match="two steering ops at resid_post.0 in one request"):
        taps.admit(request)
    taps.forget(request)
    site = taps.sites[POST0]
    assert len(site.free) == 3 and len(site.idle) == 1  # the slot the first op took is free (idle) again


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fixed", [False, True], ids=["rows", "fixed"])
def test_requests_steering_with_one_vector_share_its_slot_until_the_last_lets_go(device, fixed):
    """Requests that steer with the same vector object (a SteerSpec many requests send decodes
    to one op in the worker) and the same op and scale hold one slot between them: side by side
    their rows are one slice add; one leaving keeps the slot for the other; another op (other
    coefficients) or another vector takes a slot of its own."""
    g = torch.Generator().manual_seed(1)
    v, w = torch.randn(D, generator=g).to(device), torch.randn(D, generator=g).to(device)
    taps = _taps(device, fixed)
    site = taps.sites[POST0]
    a, b = (_request([], [_op(POST0, "add")], [v], prompt_len=2) for _ in range(2))
    c = _request([], [_op(POST0, "set")], [v], prompt_len=2)  # the same vector, set: its own slot
    for request in (a, b, c):
        taps.admit(request)
    assert len(site.free) == 2 and a.static_slots == b.static_slots != c.static_slots
    x = torch.randn(8, D, generator=g).to(device)
    taps.fill([(a, 0, 3), (b, 3, 5)], torch.tensor([0, 1, 2, 0, 1]))
    assert fixed or site.count.tolist() == [5, 2, 0, a.static_slots[0][0]]  # one span, one slot
    out = _run(taps, x[:5], None, fixed)
    assert torch.equal(out, x[:5] + v)
    taps.forget(a)
    d = _request([], [_op(POST0, "add")], [w], prompt_len=2)  # takes a free slot, never b's
    taps.admit(d)
    assert d.static_slots != b.static_slots and len(site.free) == 1
    taps.fill([(b, 0, 2), (c, 2, 4), (d, 4, 6)], torch.tensor([2, 3, 0, 1, 0, 1]))
    out = _run(taps, x[:6], None, fixed)
    torch.testing.assert_close(out[:2], x[:2] + v, atol=0, rtol=0)
    torch.testing.assert_close(out[2:4], v.expand(2, D), atol=0, rtol=0)
    torch.testing.assert_close(out[4:6], x[4:6] + w, atol=0, rtol=0)
    for request in (b, c, d):
        taps.forget(request)
    assert len(site.free) == 1 and len(site.idle) == 3  # the slots they held are free again, keeping their vectors
    # vectorless ops share by their coefficients: a factor of 0.5 and one of 2 are two slots
    e, f, h = (_request([], [_op(POST0, "scale", scale=k)], [None], prompt_len=2) for k in (0.5, 2.0, 0.5))
    for request in (e, f, h):
        taps.admit(request)
    # the free slot, then the oldest idle one taken back for the second factor
    assert not site.free and len(site.idle) == 2 and e.static_slots == h.static_slots != f.static_slots
    taps.fill([(e, 0, 2), (f, 2, 4), (h, 4, 6)], torch.tensor([0, 1, 0, 1, 0, 1]))
    out = _run(taps, x[:6], None, fixed)
    torch.testing.assert_close(out, torch.cat([0.5 * x[:2], 2 * x[2:4], 0.5 * x[4:6]]))


@pytest.mark.parametrize("fixed", [False, True], ids=["rows", "fixed"])
def test_a_free_slot_keeps_its_vector_for_the_next_request_that_sends_it(fixed):
    """A request alone (one at a time, as a client steering prompt after prompt) takes the slot
    the last one with the same decoded vector left, without writing it again, also where each
    request's vector is a copy of its own (a GPU worker moves the decoded vector per request);
    other vectors take idle slots back, the oldest first, once no slot is free; and a slot taken
    back is written with its new vector, never steered with the old one."""
    g = torch.Generator().manual_seed(2)
    vs = [torch.randn(D, generator=g) for _ in range(6)]
    taps = _taps("cpu", fixed)
    site = taps.sites[POST0]
    x = torch.randn(2, D, generator=g)

    def steer_alone(vector, kind="add"):
        request = _request([], [_op(POST0, kind)], [vector], prompt_len=2)
        request.plan.writes[0].vector = vector  # the decoded op's vector object; the request's a copy
        request.vectors = [vector.clone()]
        taps.admit(request)
        taps.fill([(request, 0, 2)], torch.arange(2))
        out = _run(taps, x, None, fixed)
        taps.forget(request)
        taps.fill([], None)
        return request.static_slots[0][0], out

    first, out = steer_alone(vs[0])
    assert torch.equal(out, x + vs[0])
    site.vec[first].zero_()  # a slot taken as it was left is not written again
    again, out = steer_alone(vs[0])
    assert again == first and torch.equal(out, x)
    site.vec[first].copy_(vs[0])
    assert steer_alone(vs[0].clone())[0] != first  # an equal vector, another object: a slot of its own
    assert len({steer_alone(v)[0] for v in vs[1:3]} | {first}) == 3
    assert not site.free and len(site.idle) == 4
    # another vector: the oldest idle slot (vs[0]'s) comes back, written with it
    slot, out = steer_alone(vs[3])
    assert slot == first and torch.equal(out, x + vs[3]) and len(site.idle) == 4
    slot, out = steer_alone(vs[0])  # vs[0] again: its slot went, so another one, written with it
    assert slot != first and torch.equal(out, x + vs[0])
    slot, out = steer_alone(vs[3], "set")  # the same vector, another op: its own slot
    assert slot != first
    torch.testing.assert_close(out, vs[3].expand(2, D), atol=0, rtol=0)


def _graph_body(taps, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of a compiled layer: its input copied (a replay must not steer the input it was
    given twice), steered at POST0 in place, then every tap reading it, through the registered
    ops, as vLLM's compiled graph calls them."""
    site = taps.sites[POST0]
    y.copy_(x)
    torch.ops.interp_engine.steer(y, None, site.vec, site.direction, site.coef, site.rows, site.slots,
                                  site.count, site.slot_of)
    for tap in taps.taps.values():
        tap.run(y, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (benchmarks/gpu_check.sh)")
def test_a_captured_cuda_graph_follows_the_maps_and_vectors_written_between_replays():
    """What vLLM does on a GPU: the compiled layer is captured once into a CUDA graph and
    replayed every step, while the runtime writes each step's row maps and slot vectors in place
    between replays (``admit``, ``fill``). A replay must follow them (other requests at other
    rows, a vector in a slot that held another, nothing at all), never the values it was
    captured with, and read nothing back to the host (a read would fail the capture)."""
    g = torch.Generator().manual_seed(3)
    v, w = torch.randn(D, generator=g).cuda(), torch.randn(D, generator=g).cuda()
    taps = _taps("cuda", True)
    x, y = torch.zeros(8, D, device="cuda"), torch.zeros(8, D, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capturing stream, as torch asks
        _graph_body(taps, x, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _graph_body(taps, x, y)

    def step(active, positions):
        taps.fill(active, positions)
        x.copy_(torch.randn(8, D, generator=g))
        graph.replay()
        got = {}
        taps.drain(_each(lambda request, address, rows, s, e: got.__setitem__((id(request), address), rows)))
        return x.clone(), y.clone(), got

    a = _request([POST0, MLP1], [_op(POST0, "add")], [v], prompt_len=3)
    b = _request([], [_op(POST0, "set")], [w], prompt_len=3)
    for request in (a, b):
        taps.admit(request)
    # rows 0-2: a; 3: padding; 4-6: b; 7: padding
    before, after, got = step([(a, 0, 3), (b, 4, 7)], torch.tensor([0, 1, 2, 9, 0, 1, 2, 9]))
    want = before.clone()
    want[0:3] += v
    want[4:7] = w
    assert torch.equal(after, want)
    assert set(got) == {(id(a), POST0), (id(a), MLP1)} and torch.equal(got[(id(a), POST0)], want[0:3].cpu())
    # a leaves; c steers from a slot b left, with another vector, at other rows, and reads
    taps.forget(a)
    taps.forget(b)
    c = _request([POST0], [_op(POST0, "add")], [v + w], prompt_len=2)
    d = _request([], [_op(POST0, "add")], [-v], prompt_len=2)
    for request in (c, d):
        taps.admit(request)
    before, after, got = step([(d, 0, 2), (c, 5, 7)], torch.tensor([0, 1, 9, 9, 9, 0, 1, 9]))
    want = before.clone()
    want[0:2] -= v
    want[5:7] += v + w
    assert torch.equal(after, want)
    assert set(got) == {(id(c), POST0)} and torch.equal(got[(id(c), POST0)], want[5:7].cpu())
    # nobody: the replay leaves every row as it came, and no tap has readers
    taps.forget(c)
    taps.forget(d)
    before, after, got = step([], None)
    assert torch.equal(after, before) and not got


def test_the_gpu_checks_kernel_check_runs_on_the_ops_as_they_are():
    """``benchmarks/gpu_check.py`` runs by hand, when a GPU is lent; its hazard check calls the
    ops directly, so it runs here too (on vLLM's CPU fused_add_rms_norm where this build has
    it), to keep it in step with the ops' signatures (it once fell behind a change to ``count``
    unnoticed until its dry run). Its engine checks use the public API, which the engine tests
    and the spec examples keep."""
    pytest.importorskip("vllm")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_here", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.kernel_hazard("cpu")
    name, ok, detail = module.RESULTS[-1]
    assert ok, f"{name}: {detail}"


@pytest.mark.parametrize("summed", [False, True], ids=["x", "x+y"])
@pytest.mark.parametrize("k", [5, 3], ids=["every-row", "first-rows"])
def test_a_tap_of_a_prefix_copies_those_rows_and_no_more(summed, k):
    """``tap_rows``'s slice path (``count[1]`` 1: rows 0..k-1), both when they are every row of
    the forward (no slices taken) and when they are the first rows only: the buffer holds
    x (or x + y) there, and nothing past row k is touched."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, D, generator=g), torch.randn(5, D, generator=g)
    buf = torch.full((MAX_TOKENS + 1, D), 7.0)
    rows, count = torch.zeros(MAX_TOKENS, dtype=torch.long), torch.tensor([k, 1])
    tap_rows(x, y if summed else None, buf, rows, count)
    want = (x + y if summed else x)[:k]
    torch.testing.assert_close(buf[:k], want, rtol=0, atol=0)
    assert bool((buf[k:] == 7.0).all())
