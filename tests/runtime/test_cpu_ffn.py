"""The C++ CPU inference kernel (csrc/cpu_ffn.cpp, runtime/cpu_ffn.py): exactness, NaN/Inf,
layouts, the plan's choice.

Exactness rule: relative error vs an fp64 reference at most 2x that of plain PyTorch in the same
dtype. The op is called with ``path="cpu"`` (the kernel at any size), and both kernel paths
(sparse up/down and the in-kernel dense branch) run on every case through the CPU record's
density thresholds; the real thresholds are tested separately.
"""

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import twell_compile
import twell_compile.ops  # noqa: F401
from tests.helpers import check_non_finite_contract
from twell_compile.testing import GatedMLP
from twell_compile import stats
from twell_compile.reference import ffn_active_only, ffn_dense
from twell_compile.runtime import arch, cpu_ffn, select, torch_impl

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module", autouse=True)
def _built():
    # A build failure must fail these tests (never skip them): the message carries the reason.
    assert cpu_ffn.active_impl() == "cpu_ffn"


@pytest.fixture(params=["sparse", "dense"])
def path(request):
    limit = 2.0 if request.param == "sparse" else -1.0
    with arch.patched(max_density_small=limit, max_density_mid=limit, max_density_large=limit):
        yield request.param


def make(m, k, n, k_out, density, dtype, *, gated=True, bias=False, tail=0.0, seed=0):
    """Anchors-style inputs: ``density`` of the gates positive on average (0 and 1 exactly)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(tail * torch.randn(m, 1, generator=g))
    x[:, 0] = 1.0
    wg = torch.randn(n, k, generator=g) / math.sqrt(k)
    if density <= 0.0:
        wg[:, 0] = -1e4
    elif density >= 1.0:
        wg[:, 0] = 1e4
    else:
        wg[:, 0] = -torch.special.ndtri(torch.tensor(1.0 - density)).item()
    wu = torch.randn(n, k, generator=g) / math.sqrt(k) if gated else None
    wd = torch.randn(k_out, n, generator=g) / math.sqrt(n * max(density, 0.01))
    b = (lambda size: torch.randn(size, generator=g) / 4) if bias else (lambda size: None)
    ts = dict(x=x, w_gate=wg, b_gate=b(n), w_up=wu, b_up=b(n) if gated else None, w_down=wd, b_down=b(k_out))
    return {key: None if t is None else t.to(dtype) for key, t in ts.items()}


def args(t):
    return t["x"], t["w_gate"], t["b_gate"], t["w_up"], t["b_up"], t["w_down"], t["b_down"]


def twell(t, layer="t", keep_stats=False, force="cpu", act="relu"):
    """The op on the C++ kernel at any size (small shapes keep these tests fast)."""
    return torch.ops.twell.ffn(*args(t), layer, keep_stats, 0, force, act)


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def check_exact(t, act="relu"):
    y = twell(t, act=act)
    dense = ffn_dense(*args(t), act)
    ref = ffn_dense(*(None if a is None else a.double() for a in args(t)), act)
    assert y.shape == dense.shape and y.dtype == dense.dtype
    assert torch.isfinite(y).all()
    if ref.norm() == 0:
        assert (y == 0).all()
        return
    e, e_dense = rel_err(y, ref), rel_err(dense, ref)
    assert e <= 2 * e_dense, f"twell rel err {e:.3e} > 2 x dense {e_dense:.3e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", [0.0, 0.01, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("m", [1, 37])
def test_exact_grid(path, dtype, density, m):
    # Odd K, N, K_out: every SIMD remainder loop runs.
    check_exact(make(m, 67, 203, 53, density, dtype, bias=True, seed=m))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated,bias", [(True, False), (False, False), (False, True)])
def test_exact_variants(path, dtype, gated, bias):
    check_exact(make(29, 130, 300, 130, 0.05, dtype, gated=gated, bias=bias, seed=3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act, gated", [("relu2", True), ("relu2", False), ("drelu", True)])
@pytest.mark.parametrize("density", [0.0, 0.05, 1.0])
def test_activations(path, dtype, act, gated, density):
    """Squared ReLU (rounded as eager's square) and dReLU in the sparse pairs and the in-kernel
    dense branch; NaN/Inf rows of x as dense; counts stay relu(g)'s, |h| the activation's."""
    t = make(23, 67, 203, 53, density, dtype, gated=gated, bias=True, seed=9)
    check_exact(t, act)
    t["x"][4, 3] = float("nan")
    t["x"][7, 1] = float("inf")
    stats.reset_stats()
    y = twell(t, layer="act", keep_stats=True, act=act)
    eager = ffn_dense(*args(t), act)
    assert torch.equal(y[[4, 7]].isnan(), eager[[4, 7]].isnan())
    fin = [r for r in range(23) if r not in (4, 7)]
    assert torch.isfinite(y[fin]).all()
    s = stats.layer_stats()["act"]
    hg = torch.relu(F.linear(t["x"], t["w_gate"], t["b_gate"]))
    assert s.mean_nnz * 23 == pytest.approx(float(((hg > 0) | hg.isnan()).sum()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_tail_and_busy_rows(path, dtype):
    t = make(300, 64, 517, 64, 0.02, dtype, tail=1.0, seed=5)
    t["x"][7] = t["x"][7].abs() * 4  # with x[:, 0] = 1 still: a row far busier than the rest
    t["x"][7, 0] = 30.0
    check_exact(t)


def test_three_dim_input_and_large_k(path):
    t = make(6, 1040, 96, 1040, 0.1, torch.float32, seed=6)
    t["x"] = t["x"].reshape(2, 3, 1040)
    check_exact(t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_weights(path, dtype):
    t = make(21, 72, 150, 40, 0.1, dtype, bias=True, seed=7)
    ref = ffn_dense(*args(t))
    fused = torch.cat([torch.randn_like(t["w_up"]), t["w_up"]])      # row slice of a fused weight
    wide = torch.cat([t["w_down"], torch.randn_like(t["w_down"])], 1)  # strided rows, unit cols
    variants = [
        dict(w_gate=t["w_gate"].t().contiguous().t(), w_up=t["w_up"].t().contiguous().t(),
             w_down=t["w_down"].t().contiguous().t()),  # transposed views (W_down^T free)
        dict(w_up=fused[150:], w_down=wide[:, :150]),
    ]
    for v in variants:
        y = twell({**t, **v})
        torch.testing.assert_close(y, ref, **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
        check_exact({**t, **v})


def promised(t, path):
    """What the kernel promises on ``path`` (the non-finite contract, docs/cpu.md): the sparse
    path sums over active neurons only, the dense branch is eager's calls."""
    return (ffn_active_only if path == "sparse" else ffn_dense)(*args(t))


def same_non_finite(y, want):
    assert torch.equal(torch.isnan(y), torch.isnan(want))
    assert torch.equal(torch.isinf(y), torch.isinf(want))
    assert torch.equal(torch.sign(y[torch.isinf(y)]), torch.sign(want[torch.isinf(want)]))


@pytest.mark.parametrize("how", ["in_place", "data", "rebind_inf"])
def test_kernel_reads_weights_as_they_are_now(path, how):
    """No derived copy: updates that bump no version counter (through .data) are seen too,
    including one that puts an Inf into W_up."""
    t = make(9, 48, 100, 48, 0.2, torch.float32, seed=8)
    wide = torch.cat([t["w_down"], t["w_down"]], 1)
    t["w_down"] = wide[:, :100]  # not a transposed view: the kernel packs W_down's columns
    y0 = twell(t)
    if how == "in_place":
        with torch.no_grad():
            wide.mul_(-3.0)
        torch.testing.assert_close(twell(t), -3.0 * y0, rtol=1e-5, atol=1e-5)
    elif how == "data":
        wide.data.mul_(-3.0)
        torch.testing.assert_close(twell(t), -3.0 * y0, rtol=1e-5, atol=1e-5)
    else:
        twell(t)
        t["w_up"].data[5, 7] = float("inf")
        y = twell(t)
        same_non_finite(y, promised(t, path))
        assert not torch.isfinite(y).all()            # neuron 5 is active in some row


@pytest.mark.parametrize("dtype", DTYPES)
def test_outputs_fully_written(path, dtype):
    # Poison the allocator's free lists with NaN blocks of the output's sizes, then run.
    t = make(37, 67, 203, 53, 0.01, dtype, bias=False, seed=9)
    for _ in range(3):
        junk = [torch.full((37, 53), float("nan"), dtype=d) for d in (dtype, torch.float32) for _ in range(4)]
        del junk
        y = twell(t)
        assert torch.isfinite(y).all()
        check_exact(t)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("poison", ["nan", "inf", "-inf", "huge"])
@pytest.mark.parametrize("m", [1, 12])
def test_non_finite_x_propagates_like_dense(path, dtype, gated, poison, m):
    t = make(m, 40, 90, 40, 0.05, dtype, gated=gated, seed=10 + m)
    value = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "huge": 1e38}[poison]
    row = m // 2
    t["x"][row, 5] = value
    if poison == "huge" and gated:
        # Finite x whose up projection overflows only at inactive neurons: eager makes
        # 0 * inf = NaN there (NaN in the whole output row); the sparse path skips them (0).
        t["w_gate"][:, 5] = 0.0
        idle = F.linear(t["x"][row], t["w_gate"], t["b_gate"]) <= 0
        t["w_up"][:, 5] = 4.0 * idle.to(t["w_up"].dtype)
    y, dense = twell(t), promised(t, path)
    same_non_finite(y, dense)
    fin = torch.isfinite(dense)
    diff = (y[fin].double() - dense[fin].double()).norm() / dense[fin].double().norm().clamp_min(1e-30)
    assert diff <= (1e-5 if dtype == torch.float32 else 3e-2)
    others = [r for r in range(m) if r != row]
    assert torch.isfinite(y[others]).all()


@pytest.mark.parametrize("active", [True, False])
@pytest.mark.parametrize("which", ["w_up", "b_up", "w_down"])
def test_non_finite_weights_follow_the_contract(path, which, active):
    """A non-finite weight of an active neuron propagates as eager's; one of a neuron no row
    activates contributes 0 on the sparse path (eager, and the dense branch: 0 * Inf = NaN)."""
    t = make(8, 32, 64, 32, 0.05, torch.float32, bias=True, seed=11)
    hg = F.relu(F.linear(t["x"], t["w_gate"], t["b_gate"]))
    on = (hg != 0).any(0)
    neuron = int(on.nonzero()[0] if active else (~on).nonzero()[0])
    if which == "w_down":
        t["w_down"][4, neuron] = float("inf")
    elif which == "w_up":
        t["w_up"][neuron, 4] = float("inf")
    else:
        t["b_up"][neuron] = float("nan")
    y, eager = twell(t), ffn_dense(*args(t))
    same_non_finite(y, promised(t, path))
    check_non_finite_contract(y, args(t))              # the contract every path keeps, GPU too
    assert not torch.isfinite(eager).all()
    assert torch.isfinite(y).all() == (path == "sparse" and not active)


def test_stats_match_plain_pytorch(path):
    t = make(33, 64, 256, 64, 0.05, torch.float32, seed=12)
    stats.reset_stats()
    twell(t, layer="cpu", keep_stats=True)
    got = stats.layer_stats()["cpu"]
    stats.reset_stats()
    torch_impl.ffn_infer(*args(t), "cpu", True)
    want = stats.layer_stats()["cpu"]
    stats.reset_stats()
    assert (got.tokens, got.hidden, got.max_nnz, got.overflows) == (want.tokens, want.hidden, want.max_nnz, 0)
    assert got.mean_nnz == want.mean_nnz
    assert got.l1 == pytest.approx(want.l1, rel=1e-5)


# ------------------------------------------------------------------------------- the plan
def test_plan_picks_the_kernel_by_dtype_tokens_and_width():
    def path(m, k, dtype):
        return select.plan_infer(torch.empty(m, k, dtype=dtype), 512, k, True, "t").path

    with arch.patched(min_tokens=4, min_width=64):
        for dtype in DTYPES:
            assert path(4, 64, dtype) == "cpu"
            assert path(3, 64, dtype) == "torch"     # fewer tokens
            assert path(4, 32, dtype) == "torch"     # narrower
        for dtype in (torch.float16, torch.float64):
            assert path(4, 64, dtype) == "torch"


def test_in_kernel_branch_follows_the_counted_density():
    t = make(64, 64, 256, 64, 0.1, torch.float32, seed=13)
    x, wg, bg, wu, bu, wd, bd = args(t)
    density = (F.linear(x, wg) > 0).float().mean().item()
    mod = cpu_ffn.extension()
    ys = {}
    # W_down in nn.Linear's layout (packed per call) and as a transposed view (read in place).
    for layout, w in (("rows", wd), ("view", wd.t().contiguous().t())):
        for thr, want_dense in ((density - 0.01, True), (density + 0.01, False)):
            y, counts, _, dense = mod.ffn_forward(x, wg, bg, wu, bu, w, bd, thr, False, 16)
            assert bool(dense) is want_dense
            assert counts.sum().item() == (F.linear(x, wg) > 0).sum().item()
            ys[layout, want_dense] = y
    for key, y in ys.items():
        torch.testing.assert_close(y, ys["rows", True], rtol=1e-5, atol=1e-5, msg=str(key))


def test_threshold_is_measured_shape_rule():
    ms = [1, 4, 16, 64, 256, 2048, 65536]
    thr = [arch.CPU.max_density(m) for m in ms]
    assert all(0.0 < v < 1.0 for v in thr)
    assert thr == sorted(thr, reverse=True)  # more tokens: dense GEMMs amortise, sparse wins less
    assert arch.CPU.max_density(2048) < 0.2 < arch.CPU.max_density(1)  # docs/cpu.md measurements


@pytest.mark.parametrize("block", [1, 8, 2048])
def test_token_blocks_give_the_same_answer(path, block):
    """The sparse part runs per block of tokens (CpuPolicy.block_tokens): several blocks, one
    token each, and one block for the whole call agree with eager."""
    t = make(37, 67, 203, 53, 0.05, torch.float32, bias=True, seed=block)
    with arch.patched(block_tokens=block):
        check_exact(t)


_NO_COMPILER = textwrap.dedent("""
    import warnings
    import torch
    from tests.runtime.test_cpu_ffn import args, make, twell
    from twell_compile.reference import ffn_dense
    from twell_compile.runtime import arch, cpu_ffn, select

    t = make(5, 16, 40, 16, 0.1, torch.float32, seed=14)
    with warnings.catch_warnings(record=True) as caught, arch.patched(min_tokens=0, min_width=0):
        warnings.simplefilter("always")
        y1, y2 = twell(t, force="auto"), twell(t, force="auto")
        assert select.plan_infer(t["x"], 40, 16, True, "t").path == "torch"
        try:
            twell(t)
            raise AssertionError("the forced C++ kernel ran without a build")
        except ValueError as e:
            assert "must build" in str(e), e
    why = "extension 'cpu_ffn': no C++ compiler: torch builds extensions with $CXX='/nonexistent/c++'"
    warned = [str(w.message) for w in caught if "CPU kernel unavailable" in str(w.message)]
    assert len(warned) == 1 and warned[0].startswith(f"twell: CPU kernel unavailable, using plain PyTorch: {why}"), warned
    assert cpu_ffn.active_impl().startswith(f"torch_impl: {why}"), cpu_ffn.active_impl()
    assert torch.equal(y1, ffn_dense(*args(t))) and torch.equal(y2, y1)
    print("ok")
""")


def test_build_failure_warns_once_and_falls_back():
    """No C++ compiler ($CXX not on PATH; a fresh process, since a process loads the extension
    once): one warning with the reason, plain PyTorch's exact result under auto, and a forced
    "cpu" path raises."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "CXX": "/nonexistent/c++", "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-c", _NO_COMPILER], capture_output=True, text=True, timeout=300,
                       env=env, cwd=root)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_compiled_model_runs_the_cpu_kernel():
    """A small layer with the kernel forced (auto: Inductor's code is faster); a forced path that
    cannot run raises, so the rewritten FFN ran the C++ kernel."""
    torch.manual_seed(15)
    net = GatedMLP(48, 160, bias=True)
    with torch.no_grad():
        net.gate.bias.fill_(-1.5)  # ~7% of gates open
    x = torch.randn(2, 7, 48)
    options = {"twell.path": "cpu"}
    with torch.no_grad():
        assert [r.tokens_shape for r in twell_compile.explain(net, x, options=options).rewrites] == ["[2, 7]"]
        out = torch.compile(net, backend="twell", options=options)(x)
        ref = net(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
