"""GPU tests of the CUDA inference launchers (runtime/cuda_infer.py): exactness of the per-row
TwELL kernels on every input (rows over the list width, long tail, NaN/Inf, odd shapes, M=1,
density 0 and 1, poisoned outputs), the 2x-of-eager error rule, the dense/TwELL plan, stats,
CUDA graphs and torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import twell_compile
import twell_compile.ops  # noqa: F401
from tests.helpers import ffn_args as _args, ffn_with_biases, poison as _poison, rel as _rel
from twell_compile.testing import GatedMLP
from twell_compile.reference import ffn_dense
from twell_compile.runtime import arch, cuda_infer, density, execute, select

pytestmark = pytest.mark.gpu
DT = [torch.bfloat16, torch.float16]
# The plan's mechanism at test sizes: small M allowed, a cost model under which TwELL wins at
# low density (the measured constants route these shapes dense).
MECHANISM = dict(min_tokens=1024, min_width=1, gate_units=1.3, pair_units=80.0)


@pytest.fixture(autouse=True)
def _fresh_policy():
    density.reset()
    with arch.patched(**MECHANISM):
        yield
    density.reset()


def _ffn(m, k, n, k_out, density, tail, dtype, gated=True, bias=True, seed=None):
    return ffn_with_biases(m, k, n, k_out, density, tail, dtype=dtype, gated=gated, bias=bias, seed=seed)


def _check_exact(p, width=32, act="relu", split=False):
    """Per-row path with list width ``width`` (heavy rows split where ``split``), vs fp32 and eager."""
    args = _args(p)
    _poison()
    y, counts, hsum = cuda_infer.twell_forward(*args, width, act, split=split)
    ref = ffn_dense(*(None if a is None else a.float() for a in args), act)
    eager = ffn_dense(*args, act)
    assert torch.isfinite(y).all(), "unwritten or non-finite output"
    if ref.norm() == 0:
        assert (y == 0).all()
        return counts
    err, derr = _rel(y, ref), _rel(eager, ref)
    assert err <= 2 * derr + 1e-6, f"rel err {err:.3e} > 2x eager's {derr:.3e}"
    return counts


@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("density,tail", [(0.0, 0.0), (0.005, 0.0), (0.005, 0.5), (0.02, 0.2),
                                          (0.2, 0.0), (0.5, 0.5), (1.0, 0.0)])
def test_exact_grid(dtype, density, tail):
    p = _ffn(3000, 256, 1000, 256, density, tail, dtype)
    counts = _check_exact(p, width=32)
    if density >= 0.2:
        assert (counts > 32).any()          # the exact tail over g ran


def _check_order(r, width, buckets):
    """The row kernels' order: every row once, by bucket (rows over W, then the rest by count in
    buckets - 1 bins), heaviest first."""
    o = r.rows_in_order().long()
    assert torch.equal(o.sort().values, torch.arange(r.cnt.numel(), device=o.device))
    c = r.cnt.long()
    lite = (buckets - 2) - c * (buckets - 1) // (width + 1)
    want = torch.where(c > width, 0, 1 + lite.clamp(min=0)) if buckets > 1 else torch.zeros_like(c)
    b = want[o]
    assert torch.equal(b, b.sort(stable=True).values), b
    assert torch.equal(r.ctr.long(), torch.bincount(want, minlength=buckets)), (r.ctr, want)
    heavy = c[o]
    if buckets > 2:    # bins by count: a row of the next bin never holds more than this one's
        firsts = heavy[b > 0]
        assert firsts.numel() == 0 or bool((firsts[:-1] + (width + 1) // (buckets - 1) + 1 >= firsts[1:]).all())


@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("act, gated", [("relu2", True), ("relu2", False), ("drelu", True)])
@pytest.mark.parametrize("density,tail", [(0.0, 0.0), (0.005, 0.0), (0.005, 0.5), (0.2, 0.0), (1.0, 0.0)])
def test_activation_grid(dtype, act, gated, density, tail):
    """Squared ReLU and dReLU on the per-row path (list loop and exact tail), the dense path
    bit-identical to eager's spelling, and the op's every inference path under the 2x rule."""
    p = _ffn(3000, 256, 1000, 256, density, tail, dtype, gated=gated)
    counts = _check_exact(p, width=32, act=act)
    hg = torch.relu(F.linear(p["x"], p["w_gate"], p["b_gate"]))
    assert torch.equal(counts, (hg != 0).sum(1).int())       # relu(g)'s non-zeros, whatever the activation
    args = _args(p)
    y, cnt, _ = cuda_infer.dense_forward(*args, act=act)
    a = hg ** 2 if act == "relu2" else hg
    u = F.linear(p["x"], p["w_up"], p["b_up"]) if gated else None
    h = a * (torch.relu(u) if act == "drelu" else u) if gated else a
    assert torch.equal(y, F.linear(h, p["w_down"], p["b_down"])) and torch.equal(cnt, counts)
    ref = ffn_dense(*(None if t is None else t.float() for t in args), act)
    derr = _rel(ffn_dense(*args, act), ref)
    with torch.no_grad():
        for path, m in (("twell", 3000), ("dense", 3000), ("decode", 12)):
            sub = [t[:m] if i == 0 else t for i, t in enumerate(args)]
            got = torch.ops.twell.ffn(*sub, "act", True, 0, path, act)
            r = ffn_dense(*(None if t is None else t.float() for t in sub), act)
            assert _rel(got, r) <= 2 * _rel(ffn_dense(*sub, act), r) + 1e-6, (path, derr)


@pytest.mark.parametrize("width", [1, 8, 64, 1024])
def test_rows_lists_match_relu_g_and_overflow_rows_exact(width):
    """vals/cols hold the first W non-zeros of relu(g) in column order, cnt all of them, order
    every row once with those over W first; rows over W (a mix at this density) stay exact."""
    p = _ffn(1200, 192, 900, 160, 0.05, 0.5, torch.bfloat16)
    r = cuda_infer.gate_rows(p["x"], p["w_gate"], p["b_gate"], width)
    hg = torch.relu(F.linear(p["x"], p["w_gate"], p["b_gate"]))
    assert torch.equal(r.cnt, (hg != 0).sum(1).int())
    for i in (0, 5, 600, 1199):
        nz = (hg[i] != 0).nonzero().reshape(-1)[:width]
        c = min(int(r.cnt[i]), width)
        assert torch.equal(r.cols[i, :c].long(), nz)
        assert torch.equal(r.vals[i, :c], hg[i, nz])
    if width in (8, 64):
        assert ((r.cnt > width).any() and (r.cnt <= width).any())
    for buckets in (1, 2, 5, 8):
        _check_order(cuda_infer.compact_rows(r.g, width, buckets=buckets), width, buckets)
    with arch.patched(compact_stages=3):     # the column loop pipelined: the same lists
        r3 = cuda_infer.compact_rows(r.g, width, buckets=8)
    assert torch.equal(r3.cnt, r.cnt)
    live = torch.arange(width, device=r.cnt.device)[None, :] < r.cnt[:, None]
    assert torch.equal(torch.where(live, r3.lst, 0), torch.where(live, r.lst, 0))
    _check_order(r3, width, 8)
    _check_order(r, width, r.ctr.numel())
    _check_exact(p, width=width)


@pytest.mark.parametrize("m,k,n,k_out,gated,bias,width", [
    (1, 2048, 5632, 2048, True, False, 16),
    (1, 100, 300, 70, False, True, 16),
    (7, 200, 1000, 136, True, True, 8),
    (513, 130, 777, 129, False, False, 16),
    (1025, 96, 2100, 96, True, True, 32),
    (300, 64, 257, 64, True, True, 32),
])
@pytest.mark.parametrize("dtype", DT)
def test_odd_shapes(m, k, n, k_out, gated, bias, width, dtype):
    p = _ffn(m, k, n, k_out, 0.05, 0.3, dtype, gated=gated, bias=bias)
    _check_exact(p, width=width)


@pytest.mark.parametrize("gated", [True, False])
def test_dense_rows_take_the_exact_tail(gated):
    # density 0.6: nearly every row is far over the list width: the tail over g does most pairs
    p = _ffn(2048, 128, 1024, 128, 0.6, 0.0, torch.bfloat16, gated=gated)
    _check_exact(p, width=64)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_propagate_like_eager(gated, bad):
    p = _ffn(1500, 256, 1000, 256, 0.01, 0.0, torch.bfloat16, gated=gated)
    rows = torch.tensor([0, 17, 1499], device="cuda")
    p["x"][rows, torch.tensor([5, 0, 255], device="cuda")] = bad
    args = _args(p)
    _poison()
    y, _, _ = cuda_infer.twell_forward(*args, 16)
    eager = ffn_dense(*args)
    assert torch.equal(torch.isnan(y), torch.isnan(eager))
    assert torch.equal(torch.isinf(y), torch.isinf(eager))
    fin = torch.ones(1500, dtype=torch.bool, device="cuda")
    fin[rows] = False
    ref = ffn_dense(*(None if a is None else a[fin].float() if i == 0 else a.float() for i, a in enumerate(args)))
    assert _rel(y[fin], ref) <= 2 * _rel(eager[fin], ref) + 1e-6


@pytest.mark.parametrize("path, m", [("twell", 300), ("decode", 12), ("dense", 300)])
@pytest.mark.parametrize("which, gated", [("w_up", True), ("b_up", True), ("w_down", True), ("w_down", False),
                                          ("x", True), ("x", False)])
def test_non_finite_values_follow_the_contract(path, m, which, gated):
    """The one contract of every path, CPU and GPU (tests/helpers.check_non_finite_contract):
    NaN/Inf in x as eager; a NaN/Inf weight of an active neuron as eager; one of an inactive
    neuron gives eager's NaN or contributes 0."""
    from tests.helpers import check_non_finite_contract

    p = _ffn(m, 256, 1000, 256, 0.02, 0.0, torch.bfloat16, gated=gated)
    p["w_gate"][10:12] = 0.0                  # neurons 10 and 11 never fire
    p["b_gate"][10:12] = -1.0
    off = torch.tensor([10, 11], device="cuda")
    on = (F.relu(F.linear(p["x"], p["w_gate"], p["b_gate"])) != 0).sum(0).argsort(descending=True)[:2]
    if which == "x":
        p["x"][1, 3], p["x"][2, 7] = float("nan"), float("-inf")
    elif which == "w_down":
        p["w_down"][5, on[0]] = float("inf")
        p["w_down"][9, off[0]] = float("inf")
    elif which == "w_up":
        p["w_up"][on[0], 3] = float("inf")
        p["w_up"][off[0], 3] = float("inf")
    else:
        p["b_up"][on[1]] = float("nan")
        p["b_up"][off[1]] = float("nan")
    args = _args(p)
    _poison()
    y = torch.ops.twell.ffn(*args, "contract", False, 0, path)
    check_non_finite_contract(y, args)


@pytest.mark.parametrize("m, k, n, k_out, density, tail, gated, width", [
    (3000, 256, 1000, 256, 0.005, 0.5, True, 32),
    (3000, 256, 1000, 256, 0.2, 0.0, False, 32),
    (2048, 2048, 5632, 2048, 0.005, 0.0, True, 256),    # the benchmark shape
    (7, 200, 1000, 136, 0.05, 0.3, True, 8),            # partial tiles of W_down
    (513, 130, 777, 129, 0.05, 0.3, False, 16),
])
def test_the_compaction_launch_transposes_w_down(m, k, n, k_out, density, tail, gated, width):
    """compact_transpose: W_down^T comes from the compaction's launch (no transpose kernel), y
    exact under the 2x rule and bit-equal to the separate transpose's; W_down stored transposed:
    no copy at all."""
    from torch.profiler import ProfilerActivity, profile

    p = _ffn(m, k, n, k_out, density, tail, torch.bfloat16, gated=gated)
    args = _args(p)
    with arch.patched(compact_transpose=False):
        want = cuda_infer.twell_forward(*args, width)[0]
    with arch.patched(compact_transpose=True):
        _poison()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            y = cuda_infer.twell_forward(*args, width)[0]
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert any("compact_rows" in k for k in names) and not any("transpose_kernel" in k for k in names), names
        assert torch.equal(y, want)
        _check_exact(p, width=width)
        stored = list(args)
        stored[5] = p["w_down"].t().contiguous().t()          # W_down stored transposed: read as it is
        assert torch.equal(cuda_infer.twell_forward(*stored, width)[0], want)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("m, density, tail, width, launch", [
    # the heaviest 256 rows in four parts where their buckets end within them, the rest whole
    (4096, 0.005, 0.05, 64, dict(row_split=4, row_split_pairs=16, row_split_rows=256, row_buckets=8)),
    # every row a candidate, heaviest first: the rows over the width (half of them) in parts too
    (4096, 0.005, 0.5, 64, dict(row_split=4, row_split_pairs=16, row_split_rows=4096, row_buckets=8)),
    # every row a candidate, in arbitrary order: thousands of rows meeting at once
    (3000, 0.02, 0.2, 32, dict(row_split=2, row_split_pairs=4, row_split_rows=4096, row_buckets=1)),
    (1, 0.2, 0.0, 32, dict(row_split=4, row_split_pairs=8, row_split_rows=256, row_buckets=8)),   # M = 1
])
def test_split_rows_are_exact_and_repeatable(m, density, tail, width, launch, gated):
    """row_split: the heaviest rows' lists cut in parts that meet in an fp32 slot; y within the
    2x rule, the same bits call after call (the rows split are whole buckets, the same whatever
    order the atomics gave a bucket's rows; the parts added in part order whichever finishes
    last), counts and |h| sums as the unsplit kernel's."""
    p = _ffn(m, 512, 2048, 384, density, tail, torch.bfloat16, gated=gated)
    args = _args(p)
    whole = cuda_infer.twell_forward(*args, width)
    with arch.patched(**launch):
        r = cuda_infer.gate_rows(args[0], args[1], args[2], width, split=True)
        cuda_infer.fused_rows(args[0], r, *args[3:])
        h = r.tick.numel()
        ends = r.ctr.long().cumsum(0)
        in_whole = ends[torch.bucketize(torch.arange(h, device=ends.device), ends, right=True)] <= h
        assert r.tick.gt(0).any(), "the point splits no row"
        assert not r.tick[~in_whole].any() and r.tick.le(launch["row_split"]).all(), "rows split outside whole buckets"
        counts = _check_exact(p, width=width, split=True)
        _poison()
        y, c2, hsum = cuda_infer.twell_forward(*args, width, split=True)
        for _ in range(3):
            _poison()
            assert torch.equal(cuda_infer.twell_forward(*args, width, split=True)[0], y), "not repeatable"
    assert torch.equal(counts, whole[1]) and torch.equal(c2, whole[1])
    torch.testing.assert_close(hsum, whole[2], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(y.float(), whole[0].float(), rtol=2e-2, atol=2e-2)


def test_fresh_inputs_repeatable():
    """Same inputs twice give the same bits (no race); fresh inputs each give a right answer."""
    for _ in range(3):
        p = _ffn(4096, 512, 1408, 512, 0.01, 0.2, torch.bfloat16)
        a = cuda_infer.twell_forward(*_args(p), 32)[0]
        b = cuda_infer.twell_forward(*_args(p), 32)[0]
        assert torch.equal(a, b)
        _check_exact(p, width=32)


def test_weight_views_and_fused_gate_up():
    p = _ffn(2048, 256, 704, 256, 0.02, 0.0, torch.bfloat16)
    gate_up = torch.cat([p["w_gate"], p["w_up"]]).contiguous()
    wd_t = p["w_down"].t().contiguous().t()            # a transposed view
    wg_t = p["w_gate"].t().contiguous().t()
    args = (p["x"], wg_t, p["b_gate"], gate_up[704:], p["b_up"], wd_t, p["b_down"])
    y = cuda_infer.twell_forward(*args, 16)[0]
    ref = ffn_dense(*(None if a is None else a.float() for a in args))
    assert _rel(y, ref) <= 2 * _rel(ffn_dense(*args), ref) + 1e-6


def test_op_plan_starts_dense_then_twell_and_stays_dense_when_dense():
    for d, want in ((0.002, "twell"), (0.3, "dense")):
        p = _ffn(4096, 256, 1024, 256, d, 0.0, torch.bfloat16)
        layer = f"policy{d}"
        assert select.plan_infer(p["x"], 1024, 256, True, layer).path == "dense"  # nothing measured
        y0 = torch.ops.twell.ffn(*_args(p), layer, True)
        torch.cuda.synchronize()
        assert select.plan_infer(p["x"], 1024, 256, True, layer).path == want
        y1 = torch.ops.twell.ffn(*_args(p), layer, True)
        ref = ffn_dense(*(None if a is None else a.float() for a in _args(p)))
        assert _rel(y1, ref) <= 2 * _rel(y0, ref) + 1e-6
        st = twell_compile.layer_stats()[layer]
        hg = torch.relu(F.linear(p["x"], p["w_gate"], p["b_gate"]))
        assert st.tokens == 4096
        assert abs(st.mean_nnz - float((hg != 0).sum()) / 4096) <= 0.01 * st.mean_nnz + 0.1


@pytest.mark.parametrize("launch", [{}, dict(row_split=4, row_split_pairs=2, row_split_rows=512, row_buckets=8,
                                         row_split_skew=0.0, row_split_max_m=0)],
                         ids=["whole-rows", "split-rows"])
@pytest.mark.parametrize("keep_stats", [True, False])
def test_graphed_per_row_calls_are_exact_fresh_and_see_weight_updates(keep_stats, launch):
    """op_rows_host_us: the per-row path replays the op's own CUDA graph (first call eager,
    second captured, then replays): fresh inputs each call, outputs never aliased, statistics
    and the density probe written, in-place weight updates seen by replays; with rows split
    (once the layer's measured peak row says so: select.splits_rows), their counters zeroed and
    their parts met again at every replay."""
    from twell_compile.runtime import decode_graphs

    decode_graphs.clear()
    p = _ffn(2048, 256, 1024, 256, 0.005, 0.0, torch.bfloat16)
    layer = f"graphed_rows{keep_stats}{sorted(launch.items())}"
    twell_compile.reset_stats()
    with arch.patched(op_rows_host_us=1e6, **launch):
        outs = []
        for i in range(10):
            if i == 5:          # the first probe has landed: the plan splits where the record lets it
                torch.cuda.synchronize()
                plan = execute.infer_plan(p["x"], 1024, 256, True, layer, 0, "twell")
                assert plan.graphed and plan.split == bool(launch), plan
            p["x"] = _inputs(2048, 256) * (1 + 0.1 * i)
            args = _args(p)
            _poison()
            y = torch.ops.twell.ffn(*args, layer, keep_stats, 0, "twell")
            ref = ffn_dense(*(None if a is None else a.float() for a in args))
            assert _rel(y, ref) <= 2 * _rel(ffn_dense(*args), ref) + 1e-6, i
            outs.append((y, ref, _rel(ffn_dense(*args), ref)))
        assert decode_graphs.count() >= 1
        torch.cuda.synchronize()
        for y, ref, derr in outs:                 # earlier outputs untouched by later replays
            assert _rel(y, ref) <= 2 * derr + 1e-6
        _updated_weights_seen(p, lambda args: torch.ops.twell.ffn(*args, layer, keep_stats, 0, "twell"))
    if keep_stats:
        _stats_match(p, layer)
    decode_graphs.clear()


def _updated_weights_seen(p, call):
    """Weights changed in place (W_up scaled, b_down shifted) reach the next call: ``call(args)``
    within the 2x rule of the new weights."""
    with torch.no_grad():
        p["w_up"].mul_(-1.5)
        p["b_down"].add_(1.0)
    args = _args(p)
    y = call(args)
    ref = ffn_dense(*(None if a is None else a.float() for a in args))
    assert _rel(y, ref) <= 2 * _rel(ffn_dense(*args), ref) + 1e-6


def _stats_match(p, layer):
    """The layer's statistics are its last call's: tokens, and relu(g)'s non-zeros per token."""
    st = twell_compile.layer_stats()[layer]
    m = p["x"].shape[0]
    hg = torch.relu(F.linear(p["x"], p["w_gate"], p["b_gate"]))
    assert st.tokens == m and abs(st.mean_nnz - float((hg != 0).sum()) / m) <= 0.01 * st.mean_nnz + 0.1


@pytest.mark.parametrize("m, launch", [(32, dict(op_dense_host_us=1e6)),
                                      (2048, dict(op_dense_prefill_host_us=1e6, min_tokens=2048))],
                         ids=["decode", "prefill"])
@pytest.mark.parametrize("keep_stats", [True, False])
def test_a_layer_kept_dense_replays_its_graph_with_statistics_and_probe_inside(keep_stats, m, launch):
    """dense_host_bound (decode sizes) and op_dense_prefill_host_us (past them): a layer the
    rules keep dense replays the op's own CUDA graph (first call eager, then captured),
    statistics or not: fresh inputs each call, outputs never aliased, the statistics and the
    density probe's count (and its peak row) taken inside the graph, in-place weight updates
    seen by replays."""
    from twell_compile.runtime import decode_graphs

    decode_graphs.clear()
    p = _ffn(m, 2048, 5632, 2048, 1.0, 0.0, torch.bfloat16)
    layer = f"graphed_dense{keep_stats}{m}"
    key = (layer, p["x"].device, torch.bfloat16, 2048, 5632, 2048, True)
    twell_compile.reset_stats()
    with arch.patched(probe_every=2, **launch):
        outs, dens, peaks = [], [], []
        for i in range(8):
            p["x"] = _inputs(m, 2048) * (1 + 0.1 * i)
            args = _args(p)
            _poison()
            y = torch.ops.twell.ffn(*args, layer, keep_stats)
            if i == 0:
                density.settle()
            ref = ffn_dense(*(None if a is None else a.float() for a in args))
            derr = _rel(ffn_dense(*args), ref)
            assert _rel(y, ref) <= 2 * derr + 1e-6, i
            outs.append((y, ref, derr))
            active = F.linear(args[0], p["w_gate"], p["b_gate"]) > 0
            dens.append(float(active.float().mean()))
            peaks.append(int(active.sum(1).max()))
        plan = select.plan_infer(p["x"], 5632, 2048, True, layer)
        assert plan.path == "dense" and plan.graphed
        assert decode_graphs.count() >= 1
        torch.cuda.synchronize()
        for y, ref, derr in outs:                 # earlier outputs untouched by later replays
            assert _rel(y, ref) <= 2 * derr + 1e-6
        assert min(dens) - 1e-3 <= density.poll(key) <= max(dens) + 1e-3   # a graphed probe's count
        assert min(peaks) <= density.peak(key) <= max(peaks)
        _updated_weights_seen(p, lambda args: torch.ops.twell.ffn(*args, layer, keep_stats))
    if keep_stats:
        _stats_match(p, layer)
    decode_graphs.clear()


def test_a_per_row_graph_replays_only_under_the_launch_sizes_it_was_captured_with():
    """A per-row call's graph is keyed by its record's launch sizes (GpuPolicy.launch_key): a
    patched record with other sizes captures its own graph, a later one with the first sizes
    replays the first graph; every result within the 2x rule, outputs poisoned before."""
    from twell_compile.runtime import decode_graphs

    decode_graphs.clear()
    p = _ffn(2048, 256, 1024, 256, 0.005, 0.0, torch.bfloat16)
    args = _args(p)
    ref = ffn_dense(*(None if a is None else a.float() for a in args))
    derr = _rel(ffn_dense(*args), ref)
    for buckets, graphs in ((2, 1), (8, 2), (2, 2)):
        with arch.patched(op_rows_host_us=1e6, row_buckets=buckets):
            for _ in range(3):                 # eager, captured (x read, y written in place), replayed
                _poison()
                y = torch.ops.twell.ffn(*args, "graph_sizes", False, 0, "twell")
                density.settle()       # the first measurement taken now (a later landing re-keys)
                assert _rel(y, ref) <= 2 * derr + 1e-6, buckets
                del y                          # its block comes back for the next call's y
        assert decode_graphs.count() == graphs, buckets
    decode_graphs.clear()


def _checked_call(p, x, layer):
    """(y, fp32 reference, eager's error) of the op on the per-row path on x and p's weights, y
    within the 2x rule; the first call's measurement taken at once (density.settle), so no
    width change from a later landing re-keys the graphs the tests count."""
    args = (x,) + _args(p)[1:]
    y = torch.ops.twell.ffn(*args, layer, False, 0, "twell")
    density.settle()
    ref = ffn_dense(*(None if a is None else a.float() for a in args))
    derr = _rel(ffn_dense(*args), ref)
    assert _rel(y, ref) <= 2 * derr + 1e-6
    return y, ref, derr


def test_graphed_per_row_calls_read_x_where_it_lies_when_its_address_repeats():
    """A per-row call whose x comes at the previous call's address replays a graph that reads
    x in place (no copy into the graph's input): values written into that same tensor between
    calls are seen, other addresses take the copying graph, at most MAX_BOUND graphs read in
    place per key, every result within the 2x rule and never aliased."""
    from twell_compile.runtime import decode_graphs

    decode_graphs.clear()
    p = _ffn(2048, 256, 1024, 256, 0.005, 0.0, torch.bfloat16)
    x = p["x"]
    others = [_inputs(2048, 256) for _ in range(4)]

    def call(xx):
        return _checked_call(p, xx, "graphed_bound")

    with arch.patched(op_rows_host_us=1e6):
        outs = [call(x)]                                   # eager
        assert decode_graphs.count() == 0
        for i in range(4):
            x.copy_(_inputs(2048, 256) * (1 + 0.2 * i))    # same tensor, new values
            outs.append(call(x))
        assert decode_graphs.count() == 1                  # one graph, reading x in place
        for i, o in enumerate(others):                     # new addresses: the copying graph
            outs.append(call(o))
        assert decode_graphs.count() == 2
        for o in others[:2]:                               # repeated: a second in-place graph
            outs.append(call(o))
            outs.append(call(o))
        assert decode_graphs.count() == 2 + decode_graphs.MAX_BOUND - 1
        torch.cuda.synchronize()
        for y, ref, derr in outs:                          # earlier outputs untouched
            assert _rel(y, ref) <= 2 * derr + 1e-6
    decode_graphs.clear()


def test_graphed_per_row_calls_write_y_where_the_allocator_hands_its_block_back():
    """Where a per-row call's y comes at the previous call's address (the caller dropped its
    last y), the graph captured then writes y in place: no clone, the block NaN-filled before
    each call is overwritten, every result within the 2x rule; outputs kept alive take other
    blocks and the graph that clones, never aliased."""
    from twell_compile.runtime import decode_graphs

    decode_graphs.clear()
    p = _ffn(2048, 256, 1024, 256, 0.005, 0.0, torch.bfloat16)
    x = p["x"]

    def call():
        return _checked_call(p, x, "graphed_out")

    with arch.patched(op_rows_host_us=1e6):
        ptrs = []
        for i in range(6):
            x.copy_(_inputs(2048, 256) * (1 + 0.2 * i))
            y = call()[0]
            ptrs.append(y.data_ptr())
            y.fill_(float("nan"))              # the block the next call's y gets
            del y
        assert decode_graphs.bindings() == [(True, True)]   # captured at the second call
        assert len(set(ptrs[1:])) == 1
        outs = []
        for i in range(4):                                  # kept: y lands elsewhere each call
            x.copy_(_inputs(2048, 256) * (1 - 0.1 * i))
            outs.append(call())
        assert sorted(decode_graphs.bindings()) == [(True, False), (True, True)]
        assert len({o[0].data_ptr() for o in outs}) == len(outs)
        torch.cuda.synchronize()
        for y, ref, derr in outs:                           # earlier outputs untouched
            assert _rel(y, ref) <= 2 * derr + 1e-6
    decode_graphs.clear()


def test_dense_paths_bit_identical_to_eager():
    # M between the decode and per-row paths, fp32 (shape rule), and a dense layer (policy):
    # eager's numbers, bit for bit
    for m, dtype in ((200, torch.bfloat16), (1024, torch.float32), (1024, torch.float16)):
        p = _ffn(m, 128, 512, 128, 0.3 if m == 1024 else 0.005, 0.0, dtype)
        for _ in range(3):
            y = torch.ops.twell.ffn(*_args(p), "dense_only", False)
            torch.cuda.synchronize()
        assert torch.equal(y, ffn_dense(*_args(p)))


@pytest.mark.parametrize("m", [1, 64, 1024, 1025])
@pytest.mark.parametrize("gated", [True, False])
def test_dense_forward_without_counts_is_eager(m, gated):
    """No statistics, no probe: eager's own relu and mul up to eager_elementwise_max_m rows (no
    counts returned), the fused pass above it; eager's bits either way, NaN included."""
    p = _ffn(m, 128, 512, 96, 0.05, 0.0, torch.bfloat16, gated=gated)
    a = _args(p)
    a[0][0, 3] = float("nan")                   # row 0 all NaN, as eager's
    y, cnt, _ = cuda_infer.dense_forward(*a, counts=False)
    ref = ffn_dense(*a)
    assert y[0].isnan().all()
    assert torch.equal(torch.nan_to_num(y, nan=7.0), torch.nan_to_num(ref, nan=7.0))
    assert (cnt is None) == (m <= arch.cuda_default().eager_elementwise_max_m)


def _inputs(m, k):
    x = torch.randn(m, k, device="cuda")
    x[:, 0] = 1.0
    return x.to(torch.bfloat16)


def test_compile_end_to_end_uses_twell():
    model = GatedMLP.at_density(256, 1024, 0.002).cuda().to(torch.bfloat16)
    f = torch.compile(model, backend="twell")
    with torch.no_grad():
        for _ in range(3):
            x = _inputs(2048, 256)
            y = f(x)
            torch.cuda.synchronize()
        ref = model.float()(x.float())
    assert any(path == "twell" for _, _, _, path in density.snapshot())
    assert _rel(y, ref) < 2e-2


def test_reduce_overhead_captures_cuda_graphs_without_skips():
    from torch._dynamo.utils import counters
    counters.clear()
    model = GatedMLP.at_density(256, 1024, 0.002).cuda().to(torch.bfloat16)
    f = torch.compile(model, backend="twell", mode="reduce-overhead")
    x = _inputs(2048, 256)
    with torch.no_grad():
        outs = []
        for _ in range(5):
            outs.append(f(x).clone())
            torch.cuda.synchronize()
        ref = model.float()(x.float())
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert _rel(outs[-1], ref) < 2e-2
    assert torch.equal(outs[-1], outs[-2])
    # the recording (second call) took the measured path: the warm-up call's measurement was
    # waited for (backend.settled), not left in flight while the dense path was recorded
    paths = {path for inst, _, d, path in density.snapshot() if inst != 0}
    assert paths == {"twell"}, density.snapshot()
    assert not density.unsettled()


def test_reduce_overhead_records_the_measured_path_without_a_sync_per_call():
    """Calls without a probe in flight never wait: after the warm-up, replays run sync-free."""
    model = GatedMLP.at_density(256, 1024, 0.002).cuda().to(torch.bfloat16)
    f = torch.compile(model, backend="twell", mode="reduce-overhead")
    x = _inputs(2048, 256)
    with torch.no_grad():
        for _ in range(3):
            f(x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                y = f(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref = model.float()(x.float())
    assert _rel(y, ref) < 2e-2
    assert {path for inst, _, d, path in density.snapshot() if inst != 0} == {"twell"}


def test_inside_cuda_graphs_the_per_row_path_starts_at_the_records_bound_for_graphs():
    """With min_tokens above the call and graphs_min_tokens at it, reduce-overhead records the
    per-row path (its warm-up call measured the layer, as a tracked dense call), while the
    default mode leaves the same call to eager's dense calls, untracked."""
    x = _inputs(2048, 256)
    for mode, want in (("reduce-overhead", {"twell"}), ("default", set())):
        torch._dynamo.reset()
        density.reset()
        model = GatedMLP.at_density(256, 1024, 0.002).cuda().to(torch.bfloat16)
        with arch.patched(min_tokens=4096, graphs_min_tokens=2048), torch.no_grad():
            options = {"twell.skip_dense": False, **({"twell.mode": mode} if mode != "default" else {})}
            f = torch.compile(model, backend="twell", options=options)
            for _ in range(4):
                y = f(x)
            torch.cuda.synchronize()
            ref = model.float()(x.float())
        assert _rel(y, ref) < 2e-2
        assert {path for inst, _, _, path in density.snapshot() if inst != 0} == want, (mode, density.snapshot())


def test_forced_kernels_run_their_path_or_refuse():
    """path= forces a path (the plan's argument): TwELL at any width the kernels take, dense,
    and a clear error where the path cannot run the call."""
    p = _ffn(300, 64, 257, 64, 0.05, 0.0, torch.bfloat16)
    ref = ffn_dense(*(None if a is None else a.float() for a in _args(p)))
    for path in ("twell", "dense", "auto"):
        y = torch.ops.twell.ffn(*_args(p), f"forced_{path}", False, 0, path)
        assert _rel(y, ref) <= 2 * _rel(ffn_dense(*_args(p)), ref) + 1e-6, path
    with pytest.raises(ValueError, match="decode path takes"):
        torch.ops.twell.ffn(*_args(p), "forced_decode", False, 0, "decode")
    with pytest.raises(ValueError, match="per-row path takes"):
        torch.ops.twell.ffn(*(a.float() if a is not None else None for a in _args(p)), "f", False, 0, "twell")
