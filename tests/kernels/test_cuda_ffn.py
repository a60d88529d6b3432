"""GPU tests of the CUDA inference path (kernels/cuda_infer.py): exactness of the TwELL kernels
(per-row path and tile path) on every input (rows over the list width, long tail, NaN/Inf,
odd shapes, M=1, density 0 and 1, poisoned outputs), the 2x-of-eager error rule, the
dense/TwELL policy, stats, CUDA graphs and torch.compile."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from synthetic import make_ffn  # noqa: E402

import twell_compile  # noqa: E402
import twell_compile.ops  # noqa: E402,F401
from twell_compile.formats import TwELL, unpack_twell  # noqa: E402
from twell_compile.reference import ffn_dense  # noqa: E402

pytestmark = pytest.mark.gpu
DT = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _fresh_policy(monkeypatch):
    from twell_compile.kernels import cuda_policy
    cuda_policy.reset()
    # Exercise the policy's mechanism at test sizes: small M allowed, a cost model under which
    # TwELL wins at low density (the measured constants route these shapes dense).
    monkeypatch.setattr(cuda_policy, "MIN_TOKENS", 1024)
    monkeypatch.setattr(cuda_policy, "MIN_WIDTH", 1)
    monkeypatch.setattr(cuda_policy, "GATE_UNITS", 1.3)
    monkeypatch.setattr(cuda_policy, "PAIR_UNITS", 80.0)
    yield


def _ffn(m, k, n, k_out, density, tail, dtype, gated=True, bias=True, seed=None):
    """Synthetic FFN (anchors.md) plus random biases, K_out may differ from K."""
    seed = torch.randint(0, 2**31, ()).item() if seed is None else seed
    p = make_ffn(m, k, n, max(density, 1e-9), tail, gated=gated, dtype=torch.float32, seed=seed)
    g = torch.Generator("cuda").manual_seed(seed + 1)
    p["w_down"] = torch.randn(k_out, n, generator=g, device="cuda") / (n * max(density, 1e-3)) ** 0.5
    if density == 0.0:
        p["w_gate"][:, 0] = -1e4            # no gate ever fires
    if bias:
        p["b_gate"] = torch.randn(n, generator=g, device="cuda") * 0.1
        p["b_up"] = torch.randn(n, generator=g, device="cuda") if gated else None
        p["b_down"] = torch.randn(k_out, generator=g, device="cuda")
    return {key: None if v is None else v.to(dtype) for key, v in p.items()}


def _args(p):
    return p["x"], p["w_gate"], p["b_gate"], p["w_up"], p["b_up"], p["w_down"], p["b_down"]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _poison():
    """Fill recently freed allocator blocks with NaN so unwritten outputs show."""
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk


def _check_exact(p, tile_n=128, slots=16, width=None, tiles=False):
    """Per-row path with list width ``width`` (tiles=True: the tile path), vs fp32 and eager."""
    from twell_compile.kernels import cuda_infer
    args = _args(p)
    _poison()
    if tiles:
        y, counts, hsum = cuda_infer.twell_forward_tiles(*args, tile_n, slots)
    else:
        y, counts, hsum = cuda_infer.twell_forward(*args, width=width)
    ref = ffn_dense(*(None if a is None else a.float() for a in args))
    eager = ffn_dense(*args)
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


@pytest.mark.parametrize("density,tail", [(0.005, 0.5), (0.2, 0.0), (1.0, 0.0)])
def test_tile_path_exact(density, tail):
    counts = _check_exact(_ffn(3000, 256, 1000, 256, density, tail, torch.bfloat16), tiles=True)
    if density >= 0.2:
        assert (counts > 16).any()


@pytest.mark.parametrize("width", [1, 8, 64, 1024])
def test_rows_lists_match_relu_g_and_overflow_rows_exact(width):
    """vals/cols hold the first W non-zeros of relu(g) in column order, cnt all of them, order
    every row once with those over W first; rows over W (a mix at this density) stay exact."""
    from twell_compile.kernels import cuda_infer
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
    o = r.order.long()                  # the row kernels' order: a permutation, rows over W first
    assert torch.equal(o.sort().values, torch.arange(len(o), device=o.device))
    over = (r.cnt[o] > width).int()
    assert torch.equal(over, over.sort(descending=True, stable=True).values)
    _check_exact(p, width=width)


@pytest.mark.parametrize("m,k,n,k_out,gated,bias,tile_n,slots", [
    (1, 2048, 5632, 2048, True, False, 128, 16),
    (1, 100, 300, 70, False, True, 128, 16),
    (7, 200, 1000, 136, True, True, 64, 8),
    (513, 130, 777, 129, False, False, 128, 16),
    (1025, 96, 2100, 96, True, True, 256, 32),
    (300, 64, 257, 64, True, True, 32, 32),
])
@pytest.mark.parametrize("dtype", DT)
def test_odd_shapes(m, k, n, k_out, gated, bias, tile_n, slots, dtype):
    p = _ffn(m, k, n, k_out, 0.05, 0.3, dtype, gated=gated, bias=bias)
    _check_exact(p, width=slots)
    _check_exact(p, tile_n, slots, tiles=True)


@pytest.mark.parametrize("gated", [True, False])
def test_overflow_buffer_exhausted_still_exact(gated):
    # density 0.6: nearly every tile overflows, far beyond the 1-in-16 buffer: recompute path.
    from twell_compile.kernels import cuda_infer
    p = _ffn(2048, 128, 1024, 128, 0.6, 0.0, torch.bfloat16, gated=gated)
    pk = cuda_infer.gate_pack(p["x"], p["w_gate"], p["b_gate"], 128, 16)
    assert int(pk.ocount) > pk.ovals.shape[0]
    _check_exact(p, tiles=True)
    _check_exact(p, width=64)


def test_gate_kernel_layout_matches_formats():
    from twell_compile.kernels import cuda_infer
    p = _ffn(700, 192, 900, 192, 0.05, 0.5, torch.bfloat16)
    pk = cuda_infer.gate_pack(p["x"], p["w_gate"], p["b_gate"], 128, 16)
    hg = torch.relu(F.linear(p["x"], p["w_gate"], p["b_gate"]))
    nt = pk.counts.shape[1]
    over = (pk.counts > 16) & (pk.oslot >= 0)
    flat = over.reshape(-1).nonzero().reshape(-1)
    tw = TwELL(pk.vals, pk.cols, pk.counts, flat, pk.ovals[pk.oslot.reshape(-1)[flat].long()], 900, 128)
    dense = unpack_twell(tw)
    stored = (~((pk.counts > 16) & (pk.oslot < 0))).repeat_interleave(128, 1)[:, :900]
    assert (dense - hg)[stored].abs().max() <= 0.02 * hg.abs().max()
    # unused slots are +0.0 / 0, and counts match eager's ReLU up to rounding at zero
    live = torch.arange(16, device="cuda") < pk.counts.unsqueeze(-1)
    assert (pk.vals[~live] == 0).all() and (pk.cols[~live] == 0).all()
    ref_counts = (hg.reshape(700, -1) != 0).float()
    ref_counts = F.pad(ref_counts, (0, nt * 128 - 900)).reshape(700, nt, 128).sum(-1)
    assert (pk.counts.float() - ref_counts).abs().sum() <= 0.002 * ref_counts.sum() + 2


@pytest.mark.parametrize("tiles", [False, True])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_propagate_like_eager(gated, bad, tiles):
    from twell_compile.kernels import cuda_infer
    p = _ffn(1500, 256, 1000, 256, 0.01, 0.0, torch.bfloat16, gated=gated)
    rows = torch.tensor([0, 17, 1499], device="cuda")
    p["x"][rows, torch.tensor([5, 0, 255], device="cuda")] = bad
    args = _args(p)
    _poison()
    fwd = cuda_infer.twell_forward_tiles if tiles else cuda_infer.twell_forward
    y, _, _ = fwd(*args, 128, 16)
    eager = ffn_dense(*args)
    assert torch.equal(torch.isnan(y), torch.isnan(eager))
    assert torch.equal(torch.isinf(y), torch.isinf(eager))
    fin = torch.ones(1500, dtype=torch.bool, device="cuda")
    fin[rows] = False
    ref = ffn_dense(*(None if a is None else a[fin].float() if i == 0 else a.float() for i, a in enumerate(args)))
    assert _rel(y[fin], ref) <= 2 * _rel(eager[fin], ref) + 1e-6


def test_fresh_inputs_repeatable():
    """Same inputs twice give the same bits (no race); fresh inputs each give a right answer."""
    from twell_compile.kernels import cuda_infer
    for _ in range(3):
        p = _ffn(4096, 512, 1408, 512, 0.01, 0.2, torch.bfloat16)
        a = cuda_infer.twell_forward(*_args(p), width=32)[0]
        b = cuda_infer.twell_forward(*_args(p), width=32)[0]
        assert torch.equal(a, b)
        _check_exact(p, width=32)


def test_weight_views_and_fused_gate_up():
    from twell_compile.kernels import cuda_infer
    p = _ffn(2048, 256, 704, 256, 0.02, 0.0, torch.bfloat16)
    gate_up = torch.cat([p["w_gate"], p["w_up"]]).contiguous()
    wd_t = p["w_down"].t().contiguous().t()            # a transposed view
    wg_t = p["w_gate"].t().contiguous().t()
    args = (p["x"], wg_t, p["b_gate"], gate_up[704:], p["b_up"], wd_t, p["b_down"])
    y = cuda_infer.twell_forward(*args, 128, 16)[0]
    ref = ffn_dense(*(None if a is None else a.float() for a in args))
    assert _rel(y, ref) <= 2 * _rel(ffn_dense(*args), ref) + 1e-6


def test_op_policy_starts_dense_then_twell_and_stays_dense_when_dense():
    from twell_compile.kernels import cuda_policy
    for density, want in ((0.002, True), (0.3, False)):
        p = _ffn(4096, 256, 1024, 256, density, 0.0, torch.bfloat16)
        layer = f"policy{density}"
        key = (layer, p["x"].device, torch.bfloat16, 256, 1024, 256, True)
        assert not cuda_policy.use_twell(key, True, 256, 1024, 256, 2)  # nothing measured yet: dense
        y0 = torch.ops.twell.ffn(*_args(p), 128, 16, layer, True)
        torch.cuda.synchronize()
        assert cuda_policy.use_twell(key, True, 256, 1024, 256, 2) == want
        y1 = torch.ops.twell.ffn(*_args(p), 128, 16, layer, True)
        ref = ffn_dense(*(None if a is None else a.float() for a in _args(p)))
        assert _rel(y1, ref) <= 2 * _rel(y0, ref) + 1e-6
        st = twell_compile.layer_stats()[layer]
        hg = torch.relu(F.linear(p["x"], p["w_gate"], p["b_gate"]))
        assert st.tokens == 4096
        assert abs(st.mean_nnz - float((hg != 0).sum()) / 4096) <= 0.01 * st.mean_nnz + 0.1


def test_dense_paths_bit_identical_to_eager():
    # M between the decode and per-row paths, fp32 (shape rule), and a dense layer (policy):
    # eager's numbers, bit for bit
    for m, dtype in ((200, torch.bfloat16), (1024, torch.float32), (1024, torch.float16)):
        p = _ffn(m, 128, 512, 128, 0.3 if m == 1024 else 0.005, 0.0, dtype)
        for _ in range(3):
            y = torch.ops.twell.ffn(*_args(p), 128, 16, "dense_only", False)
            torch.cuda.synchronize()
        assert torch.equal(y, ffn_dense(*_args(p)))


@pytest.mark.parametrize("m", [1, 64, 1024, 1025])
@pytest.mark.parametrize("gated", [True, False])
def test_dense_forward_without_counts_is_eager(m, gated):
    """No statistics, no probe: eager's own relu and mul up to EAGER_ELEMENTWISE_MAX_M rows (no
    counts returned), the fused pass above it; eager's bits either way, NaN included."""
    from twell_compile.kernels import cuda_infer

    p = _ffn(m, 128, 512, 96, 0.05, 0.0, torch.bfloat16, gated=gated)
    a = _args(p)
    a[0][0, 3] = float("nan")                   # row 0 all NaN, as eager's
    y, cnt, _ = cuda_infer.dense_forward(*a, counts=False)
    ref = ffn_dense(*a)
    assert y[0].isnan().all()
    assert torch.equal(torch.nan_to_num(y, nan=7.0), torch.nan_to_num(ref, nan=7.0))
    assert (cnt is None) == (m <= cuda_infer.EAGER_ELEMENTWISE_MAX_M)


class _MLP(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.gate_proj = nn.Linear(k, n, bias=False)
        self.up_proj = nn.Linear(k, n, bias=False)
        self.down_proj = nn.Linear(n, k, bias=False)
        p = make_ffn(8, k, n, 0.002, 0.0, dtype=torch.float32)
        with torch.no_grad():
            self.gate_proj.weight.copy_(p["w_gate"])
            self.up_proj.weight.copy_(p["w_up"])
            self.down_proj.weight.copy_(p["w_down"])

    def forward(self, x):
        return self.down_proj(F.relu(self.gate_proj(x)) * self.up_proj(x))


def _inputs(m, k):
    x = torch.randn(m, k, device="cuda")
    x[:, 0] = 1.0
    return x.to(torch.bfloat16)


def test_compile_end_to_end_uses_twell():
    from twell_compile.kernels import cuda_policy
    model = _MLP(256, 1024).cuda().to(torch.bfloat16)
    f = torch.compile(model, backend="twell")
    with torch.no_grad():
        for _ in range(3):
            x = _inputs(2048, 256)
            y = f(x)
            torch.cuda.synchronize()
        ref = model.float()(x.float())
    assert any(st.density is not None and cuda_policy.twell_wins(st.density, True, 256, 1024, 256, 2)
               for st in cuda_policy._layers.values())
    assert _rel(y, ref) < 2e-2


def test_reduce_overhead_captures_cuda_graphs_without_skips():
    from torch._dynamo.utils import counters
    counters.clear()
    model = _MLP(256, 1024).cuda().to(torch.bfloat16)
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
