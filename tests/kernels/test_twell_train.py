"""The CUDA training kernels (kernels/twell_train_*.py, through runtime/cuda_train.py) on the CPU under TRITON_INTERPRET=1, tiny
odd shapes, one subprocess per case (the interpreter is chosen when kernels are defined).

Each case runs the sparse forward + sparse backward, the dense forward + dense backward, and
the dense forward's compact state (and the sparse one's) into the densifying backward, against fp64 autograd of the same loss (sum(y * dy) + l1 * mean|h|): every gradient within 2x
of fp16 eager autograd's error, NaN patterns equal to eager's, the sparse state unpacking bit
for bit to relu(g), the dense state holding g and u bit for bit. fp16 only (see
test_twell_rows.py)."""

from __future__ import annotations

import os
import textwrap

import pytest

from tests.helpers import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import math, torch, torch.nn.functional as F
    from twell_compile.runtime import arch, cuda_train as ct
    from twell_compile.formats import Hybrid, backup_capacity, unpack_hybrid
    dy_ent, x_ent, chunk, per_sm = {ent}
    via_coef = {coef}      # the penalty's coefficient read from a device tensor (L1_DEV): 2 x half the scale
    # several K chunks per neuron in the weight-gradient kernel, several steps per neuron; small
    # chunks split the neurons' lists over programs (atomic sums), few programs loop over many
    PATCH = arch.patched(wg_bk=32, wg_dy_entries=dy_ent, wg_x_entries=x_ent, wg_chunk=chunk,
                 wg_chunk_over_mean=0 if chunk < 8 else 2, wg_programs_per_sm=per_sm,
                 wg_dy_maxnreg=128, wg_x_maxnreg=96)   # register caps passed through (the interpreter ignores them)
    PATCH.__enter__()     # held: a context manager nothing refers to is closed at once
    assert arch.launch_policy('cpu').wg_bk == 32
    torch.manual_seed({seed})
    m, k, n, ko, gated, bias, width, brows, bad, l1, dens = {case}
    act = {act!r}
    from twell_compile.reference import activate
    dt = torch.float16
    x = torch.randn(m, k)
    x[:, 0] = 1.0
    x[: m // 3] *= 1.6                                     # busier rows
    wg = torch.randn(n, k) / (k - 1) ** .5
    shift = -1e4 if dens == 0 else (8.0 if dens == 1 else
                                    -float(torch.special.ndtri(torch.tensor(1 - dens, dtype=torch.float64))))
    wg[:, 0] = shift
    ws = dict(x=x, w_gate=wg,
              b_gate=torch.randn(n) * .1 if bias else None,
              w_up=torch.randn(n, k) / k ** .5 if gated else None,
              b_up=torch.randn(n) if bias and gated else None,
              w_down=torch.randn(ko, n) / (n * max(dens, .05)) ** .5,
              b_down=torch.randn(ko) if bias else None)
    ws = {{key: None if v is None else v.to(dt) for key, v in ws.items()}}
    if bad:
        ws["x"][1, 3] = float("nan"); ws["x"][2, 5] = float("inf")
    dy = torch.randn(m, ko).to(dt)
    if bad:
        dy[3, 1] = float("nan")
    names = ["x", "w_gate", "b_gate", "w_up", "b_up", "w_down", "b_down"]
    args = [ws[a] for a in names]
    l1s = 0.5 if l1 else 0.0

    def autograd(dtype):
        leaves = [None if a is None else a.to(dtype).requires_grad_() for a in args]
        xx, wg_, bg_, wu_, bu_, wd_, bd_ = leaves
        hg = torch.relu(F.linear(xx, wg_, bg_))
        h = activate(hg, F.linear(xx, wu_, bu_) if gated else None, act)
        y = F.linear(h, wd_, bd_)
        loss = (y * dy.to(dtype)).sum() + l1s * h.abs().mean()
        loss.backward()
        return y.detach(), [None if a is None else a.grad for a in leaves]

    yref, gref = autograd(torch.float64)
    yeag, geag = autograd(dt)
    cap = int(backup_capacity(m, brows))

    def rel(a, b):
        fin = torch.isfinite(b)
        return float((a.double()[fin] - b[fin]).norm() / b[fin].norm().clamp_min(1e-30))

    def check(tag, y, grads):
        if y is not None:
            assert torch.equal(torch.isnan(y), torch.isnan(yeag)), (tag, "y nan")
            e, d = rel(y, yref), rel(yeag, yref)
            assert e <= 2 * d + 1e-6, (tag, "y", e, d)
        for name, g, r, ge in zip(names, grads, gref, geag):
            if r is None:
                assert g is None, (tag, name)
                continue
            assert g.dtype == dt and g.shape == r.shape, (tag, name, g.dtype, g.shape)
            if act == "drelu":    # d_u is dh * 0 where relu(g) is 0 (kernels/act.py): NaN there for NaN dy
                assert not (torch.isnan(ge) & ~torch.isnan(g)).any(), (tag, name, "nan pattern")
            else:
                assert torch.equal(torch.isnan(g), torch.isnan(ge)), (tag, name, "nan pattern",
                                                                     torch.isnan(g).sum(), torch.isnan(ge).sum())
            both = ~torch.isnan(g) & ~torch.isnan(ge)
            e, d = rel(g[both], r[both]), rel(ge[both], r[both])
            assert e <= 2 * d + 1e-6, (tag, name, e, d)

    def state_ok(tag, st):
        cnt, cols, ell_g, ell_u, bidx, bg, bu = st
        g = F.linear(args[0], args[1], args[2])
        hg = torch.relu(g)
        assert torch.equal(cnt, (hg != 0).sum(1).int() if not bad else cnt), tag
        fin = torch.isfinite(args[0]).all(1)
        assert torch.equal(cnt[fin], (hg[fin] != 0).sum(1).int()), (tag, "counts")
        rows = bidx[bidx >= 0]
        assert len(set(rows.tolist())) == rows.numel(), (tag, "backup rows unique")
        busy = (cnt > width) | ~fin
        assert busy[rows].all() and rows.numel() == min(int(busy.sum()), cap), (tag, "backup rows")
        rec = lambda r: torch.relu(F.linear(args[0][r], args[1], args[2]))
        dense = unpack_hybrid(Hybrid(ell_g, cols, cnt, bidx, bg), n, rec)
        same = (dense.view(torch.int16) == hg.view(torch.int16)) | (torch.isnan(dense) & torch.isnan(hg))
        assert same[fin].all(), (tag, "state != relu(g)")

    l1c = (l1s / 2 if via_coef else l1s) / max(m * n, 1)
    coef = torch.tensor([2.0]) if via_coef else None

    def backward(sparse, st):
        if sparse == "densify":
            out = ct.backward_densify(dy, *args[:6], *st, l1c, act, coef)
        elif sparse:
            out = ct.backward_sparse(dy, *args[:6], *st, l1c, act, coef)
        else:
            out = ct.backward_dense(dy, *args[:6], st[5], st[6] if gated else None, l1c, act, coef)
        dx, dwg, dbg, dwu, dbu, dwd = out
        return [dx, dwg, dbg, dwu, dbu, dwd, dy.sum(0) if bias else None]

    y, hsum, *st, missing = ct.forward_sparse(*args, width, cap, act)
    assert hsum.shape == (m,)
    state_ok("sparse", st)
    check("sparse/sparse", y, backward(True, st))
    yd, hsumd, (*std, missd) = ct.forward_dense(*args, width, cap, act=act)
    cnt_d, _, _, _, bidx_d, g_d, u_d = std
    g = F.linear(args[0], args[1], args[2])
    assert torch.equal(bidx_d, torch.arange(m)), "dense state rows"
    assert int(missd) == int(missing), ("rows past the backup", int(missd), int(missing))
    assert torch.equal(g_d.view(torch.int16), g.view(torch.int16)), "dense state g"
    if gated:
        assert torch.equal(u_d.view(torch.int16), F.linear(args[0], args[3], args[4]).view(torch.int16)), "dense u"
    fin = torch.isfinite(args[0]).all(1)
    assert torch.equal(cnt_d[fin], (torch.relu(g[fin]) != 0).sum(1).int()), "dense counts"
    hd = activate(torch.relu(F.linear(args[0], args[1], args[2])),
                  F.linear(args[0], args[3], args[4]) if gated else None, act)
    assert torch.allclose(hsumd, hd.float().abs().sum(1), rtol=1e-3, atol=1e-3, equal_nan=True), "dense |h| sums"
    check("dense/dense", yd, backward(False, std))
    yc, _, (*stc, missc) = ct.forward_dense(*args, width, cap, compact=True, act=act)
    state_ok("compact", stc)
    assert int(missc) == int(missing), ("compact lost rows", int(missc), int(missing))
    check("compact/densify", yc, backward("densify", stc))
    check("sparse/densify", None, backward("densify", st))
    print("ok missing", int(missing), "busy", int((st[0] > width).sum()))
""")

CASES = [
    # m, k, n, k_out, gated, bias, ell width, backup_rows, nan/inf, l1, density
    (7, 40, 100, 24, True, True, 8, 2, False, False, 0.05),   # busy rows, all in the backup
    (9, 33, 70, 40, True, False, 2, 1000, False, True, 0.1),  # backup (2 rows) overflows: recompute
    (6, 40, 70, 17, False, True, 4, 3, False, True, 0.1),     # non-gated, L1
    (5, 40, 50, 24, True, True, 8, 2, False, False, 0.0),     # nothing fires
    (5, 24, 50, 24, True, True, 8, 2, False, True, 1.0),      # everything fires, L1
    (6, 40, 70, 40, True, True, 4, 3, True, False, 0.05),     # NaN/Inf in x, NaN in dy
    (6, 40, 70, 40, False, False, 4, 1000, True, False, 0.05),  # the same, non-gated, no backup room
    (0, 40, 70, 24, True, True, 8, 2, False, True, 0.1),      # no rows: empty y and dx, zero weight grads
    (11, 40, 70, 24, True, True, 6, 2, False, True, 0.06),    # a list width not a power of 2 (entry codes m * 8 + p)
    (40, 24, 24, 16, True, True, 16, 2, False, True, 0.3),   # ~12 entries per neuron: many wgrad steps
]


# wgrad entries per step (DY, X), entries per chunk, programs per SM (4 "SMs" on the CPU):
# small ones give several steps and chunks per neuron and several chunks per program in every
# case; the last case (~12 entries per neuron) also runs the shipped config (the records')
# (coef: the L1 cases again with the coefficient read from a device tensor, as
# twell.target_density's controller hands it to the backward)
@pytest.mark.parametrize("case, ent, coef", [(c, (1, 2, 3, 1), False) for c in CASES]
                         + [(CASES[-1], (4, 4, 128, 8), False)]
                         + [(c, (1, 2, 3, 1), True) for c in (CASES[1], CASES[2], CASES[-1])])
def test_train_kernels_under_interpreter(case, ent, coef):
    run_interpreted(SCRIPT.format(seed=sum(case[:4]), case=case, ent=ent, coef=coef, act="relu"), timeout=300)


# squared ReLU (gated, non-gated) and dReLU: the same forwards, states and backwards, the
# activation's derivative formed from relu(g) and u (kernels/act.py); L1 on the h fed to down
@pytest.mark.parametrize("act, case", [("relu2", CASES[i]) for i in (0, 1, 2, 5, 6)]
                         + [("drelu", CASES[i]) for i in (0, 1, 4, 5)])
def test_train_activations_under_interpreter(act, case):
    run_interpreted(SCRIPT.format(seed=sum(case[:4]) + 4, case=case, ent=(1, 2, 3, 1), coef=False, act=act),
                    timeout=300)


SETUP_SCRIPT = textwrap.dedent("""
    import torch
    from twell_compile.kernels.twell_train_bwd import backup_rows_kernel
    from twell_compile.kernels.twell_train_wgrad import chunk_map_kernel, wgrad_plan_kernel
    from twell_compile.runtime.cuda_train import backup_slots
    from twell_compile.runtime.launch import launch
    torch.manual_seed({seed})
    n, floor_, over, block, m, k, ko, cap = {case}
    # the plan: hist with empty, typical and hot neurons; outputs poisoned first
    hist = torch.randint(0, 50, (n,), dtype=torch.int32)
    hist[::7] = 0
    hist[1::11] = 900
    off, coff = torch.full((2, n), -77, dtype=torch.int32).unbind(0)
    ctot, chunk = torch.full((2,), -77, dtype=torch.int32).split(1)
    launch(wgrad_plan_kernel, (1,), (hist, off, coff, ctot, chunk, n, floor_, over), dict(B=block), num_warps=4)
    want_chunk = max((int(hist.sum()) // n) * over, floor_)
    nch = torch.clamp_min((hist + want_chunk - 1) // want_chunk, 1)
    assert int(chunk) == want_chunk, (int(chunk), want_chunk)
    assert torch.equal(off, torch.cumsum(hist, 0, dtype=torch.int32) - hist)
    assert torch.equal(coff, (torch.cumsum(nch, 0) - nch).to(torch.int32))
    assert int(ctot) == int(nch.sum())
    # the chunk map from the plan's offsets: each neuron's chunks name it (poisoned first)
    nid = torch.full((int(ctot) + 5,), -77, dtype=torch.int32)
    launch(chunk_map_kernel, (n,), (coff, ctot, nid, n), dict(BJ=32), num_warps=1)
    assert torch.equal(nid[: int(ctot)], torch.repeat_interleave(torch.arange(n, dtype=torch.int32), nch))
    assert (nid[int(ctot):] == -77).all()
    # the backup rows: slots of some rows in any order, padding slots (-1) last; the slots alone
    # (the densify backward's) the same
    x = torch.randn(m, k).to(torch.float16)
    dy = torch.randn(m, ko).to(torch.float16)
    rows = torch.randperm(m)[: cap - 2].to(torch.int64)
    bidx = torch.cat([rows, torch.full((2,), -1, dtype=torch.int64)])
    slot_of = torch.full((m + 1,), -1, dtype=torch.int32)
    xb = torch.full((cap, k), float("nan"), dtype=torch.float16)
    dyb = torch.full((cap, ko), float("nan"), dtype=torch.float16)
    launch(backup_rows_kernel, (cap,), (bidx, slot_of, x, x.stride(0), dy, dy.stride(0), xb, dyb, k, ko),
           dict(BK=block, ROWS=True), num_warps=4)
    want = torch.full((m + 1,), -1, dtype=torch.int32)
    want[rows] = torch.arange(cap - 2, dtype=torch.int32)
    assert torch.equal(slot_of, want)
    assert torch.equal(xb[: cap - 2], x[rows]) and torch.equal(dyb[: cap - 2], dy[rows])
    assert (xb[cap - 2:] == 0).all() and (dyb[cap - 2:] == 0).all()
    got = backup_slots(bidx, m, x, dy)                # the launcher both backward paths call
    assert torch.equal(got[0], want) and torch.equal(got[1], xb) and torch.equal(got[2], dyb)
    alone, no_x, no_dy = backup_slots(bidx, m)
    assert torch.equal(alone, want) and no_x is None and no_dy is None
    print("ok")
""")


# the setup's kernels against their torch formulas: the plan's scans over several blocks (and
# one), its chunk length from the mean or the floor, the chunk map from its offsets; the backup rows'
# slots, rows and padding, through the launcher and alone
@pytest.mark.parametrize("case", [
    # N, floor, over, block, M, K, K_out, backup slots
    (300, 128, 2, 64, 40, 70, 24, 9),
    (37, 1, 3, 64, 5, 8, 130, 4),
    (1000, 16, 0, 1024, 64, 33, 33, 10),
])
def test_setup_kernels_under_interpreter(case):
    run_interpreted(SETUP_SCRIPT.format(seed=sum(case), case=case), timeout=120)


# The wgrad passes' entry loop, compiled for sm_90a here (benchmarks/probes/sass_loop.py: Triton's
# own ptxas and cuobjdump, no GPU): no subroutine call. A 64-bit m = idx // W compiled to an
# 84-instruction division routine, called once per entry between the order load and the row gather.
@pytest.mark.parametrize("preset", ["wgrad_dy", "wgrad_x"])
def test_wgrad_passes_call_no_division_routine(preset):
    import triton

    from benchmarks.probes import sass_loop
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip(f"Triton {triton.__version__}: ASTSource's constexpr keys differ before 3.7")
    if not (sass_loop.tools() / "cuobjdump").exists():
        pytest.skip("this Triton carries no cuobjdump")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: the kernels are interpreted here, nothing compiles")
    p = sass_loop.PRESETS[preset]()
    p["consts"].update(HAS_BG=True, HAS_BU=True, L1=True)
    s = sass_loop.first_loop(sass_loop.compile_sass(p)[0])
    assert s["loop"].get("LDG")                        # the entry loop: its gathers
    assert "CALL" not in s["kernel"], s
