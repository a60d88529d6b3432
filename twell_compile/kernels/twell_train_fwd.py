"""Triton device code: the training forward's per-row kernel (after the cuBLAS gate GEMM and
``twell_rows.compact_rows_kernel``), writing y and the hybrid state of formats.Hybrid.

One program per token row m (rows over W first: ``order`` from the compaction), x row and
y row in registers:
  * busy rows (count > W, or x holding NaN/Inf) take a backup slot from an atomic counter;
    a slot < C stores the row's relu(g) densely (backup_g) and u at its non-zeros (backup_u,
    every column for non-finite x; zero elsewhere);
    busy rows past C are left to the backward, which recomputes them exactly from x.
  * list loop over the first min(count, W) listed pairs: u = x . W_u[n] (+ b_u), h = g * u,
    y += h * W_d^T[n]; (col, g, u) written to the ELL slots (cols, ell_g, ell_u).
  * scan over g: backup rows from column 0 (their dense rows), other rows over W after the
    W-th listed column, rows with non-finite x every column (0 * Inf = NaN as in eager).
    y only takes columns the list loop did not.
Y=False (dense forward, y computed by cuBLAS): only the state is written; u read from the
dense u tensor; no weight rows loaded. No capacity can drop a non-zero: rows past the backup
are complete in ``cnt`` and recomputed, never truncated.
"""

import triton
import triton.language as tl

from twell_compile.kernels.act import hidden
from twell_compile.kernels.pairs import pick, scan, select
from twell_compile.kernels.twell_rows import row_at


@triton.jit
def _up(xr, n, live, wu_ptr, swu_n, bu_ptr, ks, k_ok, u_ptr, su_m, m,
        GATED: tl.constexpr, HAS_BU: tl.constexpr, Y: tl.constexpr):
    """u at columns n [PAIRS] in fp32: x . W_u[n] (+ b_u) when Y, else read from dense u."""
    if GATED:
        if Y:
            wu = tl.load(wu_ptr + n[:, None] * swu_n + ks[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
            u = tl.sum(wu.to(tl.float32) * xr[None, :], axis=1)
            if HAS_BU:
                u += tl.load(bu_ptr + n, mask=live, other=0.0).to(tl.float32)
        else:
            u = tl.load(u_ptr + m * su_m + n, mask=live, other=0.0).to(tl.float32)
    else:
        u = tl.zeros(n.shape, dtype=tl.float32)
    return u


@triton.jit
def train_fwd_kernel(
    x_ptr, sx_m, g_ptr, sg_m, list_ptr, cnt_ptr, order_ptr, u_ptr, su_m,
    wu_ptr, swu_n, bu_ptr, wdt_ptr, swd_n, bd_ptr,
    y_ptr, sy_m, hsum_ptr,
    cols_ptr, ellg_ptr, ellu_ptr, bidx_ptr, bg_ptr, bu2_ptr, ctr_ptr,
    M, K, N, KO, W, C,
    GATED: tl.constexpr, HAS_BU: tl.constexpr, HAS_BD: tl.constexpr, Y: tl.constexpr,
    K_P: tl.constexpr, KO_P: tl.constexpr, PAIRS: tl.constexpr, CH: tl.constexpr,
    ACT: tl.constexpr,
):
    m = row_at(order_ptr, ctr_ptr + 1, tl.program_id(0), M, 2)     # rows over W first
    ks = tl.arange(0, K_P)
    k_ok = ks < K
    ko = tl.arange(0, KO_P)
    ko_ok = ko < KO
    xr = tl.load(x_ptr + m * sx_m + ks, mask=k_ok, other=0.0).to(tl.float32)
    bad = tl.sum(((xr != xr) | (tl.abs(xr) == float("inf"))).to(tl.int32), axis=0) > 0
    cnt = tl.load(cnt_ptr + m)
    nl = tl.minimum(cnt, W)
    busy = (cnt > W) | bad
    slot = tl.atomic_add(ctr_ptr, 1, mask=busy)
    slot = tl.where(busy, slot, C)
    ins = busy & (slot < C)
    tl.store(bidx_ptr + slot, m, mask=ins)
    dt = g_ptr.dtype.element_ty
    pa = tl.arange(0, PAIRS)
    acc = tl.zeros((KO_P,), dtype=tl.float32)
    hs = tl.zeros((PAIRS,), dtype=tl.float32)
    lrow = m * W
    brow = slot.to(tl.int64) * N

    # 1. the listed pairs: ELL slots, and y unless the row's x is non-finite
    live = pa < nl
    pk = tl.load(list_ptr + lrow + pa, mask=live, other=0)
    for p0 in range(0, nl, PAIRS):
        p = p0 + pa
        live1 = (p + PAIRS) < nl                # next pairs' list entries, one step ahead
        pk1 = tl.load(list_ptr + lrow + p + PAIRS, mask=live1, other=0)
        n = ((pk >> 16) & 0xFFFF).to(tl.int64)
        gq = (pk & 0xFFFF).to(tl.int16).to(dt, bitcast=True)
        gv = gq.to(tl.float32)
        u = _up(xr, n, live, wu_ptr, swu_n, bu_ptr, ks, k_ok, u_ptr, su_m, m, GATED, HAS_BU, Y)
        tl.store(cols_ptr + lrow + p, n.to(tl.int32), mask=live)
        tl.store(ellg_ptr + lrow + p, gq, mask=live)
        if GATED:
            tl.store(ellu_ptr + lrow + p, u.to(dt), mask=live)
            tl.store(bu2_ptr + brow + n, u.to(dt), mask=tl.where(ins, live, False))
        if Y:
            h = hidden(gv, u, GATED, ACT)
            h = tl.where(live & (~bad), h, 0.0)
            wd = tl.load(wdt_ptr + n[:, None] * swd_n + ko[None, :], mask=live[:, None] & ko_ok[None, :], other=0.0)
            acc += tl.sum(h[:, None] * wd.to(tl.float32), axis=0)
            hs += tl.abs(h)
        pk, live = pk1, live1

    # 2. scan over g (see the module docstring for which rows and columns)
    over = cnt > W
    last = ((tl.load(list_ptr + lrow + W - 1, mask=over, other=0) >> 16) & 0xFFFF).to(tl.int64)
    if Y:
        start = tl.where(ins | bad, 0, tl.where(over, last + 1, N))
    else:
        start = tl.where(ins, 0, N)
    cc = tl.arange(0, CH)
    for c0 in range(start, N, CH):
        cn = c0 + cc
        c_ok = cn < N
        graw = tl.load(g_ptr + m * sg_m + cn, mask=c_ok, other=0.0)
        v = tl.where(graw < 0.0, 0.0, graw)                        # relu, NaN kept
        tl.store(bg_ptr + brow + cn, v, mask=tl.where(ins, c_ok, False))
        vf = v.to(tl.float32)
        act = ((vf != 0.0) | bad) & c_ok
        incl, na = scan(act)
        for q in range(0, na, PAIRS):
            sel, t_live, tn = select(act, incl, na, q, pa, c0, cc)
            tg = pick(sel, vf)
            # columns the list loop did not take (all of them for non-finite x)
            take = tl.where(bad, t_live, tl.where(over, t_live & (tn > last), False))
            u = _up(xr, tn, take, wu_ptr, swu_n, bu_ptr, ks, k_ok, u_ptr, su_m, m, GATED, HAS_BU, Y)
            if GATED:
                tl.store(bu2_ptr + brow + tn, u.to(dt), mask=tl.where(ins, take, False))
            if Y:
                h = hidden(tg, u, GATED, ACT)
                h = tl.where(take, h, 0.0)
                wd = tl.load(wdt_ptr + tn[:, None] * swd_n + ko[None, :], mask=take[:, None] & ko_ok[None, :], other=0.0)
                acc += tl.sum(h[:, None] * wd.to(tl.float32), axis=0)
                hs += tl.abs(h)
    if Y:
        if HAS_BD:
            acc += tl.load(bd_ptr + ko, mask=ko_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * sy_m + ko, acc.to(y_ptr.dtype.element_ty), mask=ko_ok)
        tl.store(hsum_ptr + m, tl.sum(hs, axis=0))
