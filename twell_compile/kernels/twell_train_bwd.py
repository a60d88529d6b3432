"""Triton device code: the training backward's per-row kernels (sparse path).

For every active (m, n) pair, with h_g = relu(g) and u as saved:

    dh  = dy[m] . W_d^T[n]               (+ l1c * sgn(h) with L1; l1c times *l1_ptr with L1_DEV)
    d_g = dh * u * [not h_g <= 0]        (non-gated: dh * [...]; NaN passes, as threshold_backward)
    d_u = dh * h_g,  h = h_g * u
    dx[m] += d_g * W_g[n] + d_u * W_u[n]

``rank_kernel``, BM rows per program, classifies each row and ranks the quiet ones' slots:
  * quiet rows (count <= W, finite x and dy): each ELL slot's rank in its column, from an
    atomic on hist[n] (for the counting sort); q[m] = count. Their dh, d_g, d_u come from
    the per-neuron DY pass (twell_train_wgrad.py), their dx from ``dx_rows_kernel``.
  * busy rows: q[m] = -1, appended to a list (one atomic per program).
  (The ranks were first taken in the busy-row kernel, one row per program, 4 slots per
  serial atomic: 0.32 ms at M=16384, d=0.005, H200.)
``backup_rows_kernel``, one program per dense-backup slot s, before the others: slot_of[r] = s for
the slot's row r (slot_of holds -1 for rows without one) and, with ROWS, that row's x and dy
copied to xb[s], dyb[s] (zeros for a padding slot), the operands of the backup rows' cuBLAS
products (the densify backward takes the slots alone).
``train_bwd_kernel``, a fixed grid of G programs striding over the busy-row list:
  * busy rows in the dense backup (slot_of[m] >= 0): the backup row scanned CH columns at a
    time, non-zeros picked with a prefix count (as twell_rows' tail); values into row ``slot``
    of zero-filled [C, N] buffers (cuBLAS products with the gathered x / dy rows); dx here.
  * other busy rows (past the backup, or non-finite dy): g and u recomputed from x, CH columns
    x BK of K per step, fp32 rounded to the dtype (as cuBLAS rounds), for dx; the row is
    appended to mlist (atomic counter) and wgrad_kernel recomputes its weight-gradient terms
    per neuron. Rare by design (slow, exact).
  Busy rows' dx is written here.
Rows with non-finite x or dy take every column, so NaN/Inf spread as in dense autograd
(d_u = NaN * 0 on the whole row of a non-finite dy, 0 * NaN in the products with x).

``dx_rows_kernel``, one program per quiet row: dx[m] = sum over its slots of d_g W_g[n] +
d_u W_u[n], PAIRS slots per step (the next slots' (n, d_g, d_u) loaded one step ahead). Only
W_g and W_u rows are gathered (46 MB at K=2048, N=5632 bf16: L2-sized), where the former
single row kernel gathered W_d^T rows too (69 MB) and took ~1.5 ms (H200, M=16384, d=0.005).
"""

import triton
import triton.language as tl

from twell_compile.kernels.act import grads, hidden
from twell_compile.kernels.pairs import pick, scan, select


@triton.jit
def _pairs(dxa, n, hg, u, live, dyr, wg_ptr, swg_n, wu_ptr, swu_n, wdt_ptr, swd_n,
           l1c, ks, k_ok, ko, ko_ok, GATED: tl.constexpr, L1: tl.constexpr, ACT: tl.constexpr):
    """dx += d_g W_g[n] + d_u W_u[n] for PAIRS pairs; returns (dx, d_g, d_u, h) in fp32 (h and
    the derivatives of the activation ACT: kernels/act.py)."""
    wd = tl.load(wdt_ptr + n[:, None] * swd_n + ko[None, :], mask=live[:, None] & ko_ok[None, :], other=0.0)
    dh = tl.sum(wd.to(tl.float32) * dyr[None, :], axis=1)
    h = hidden(hg, u, GATED, ACT)
    if L1:
        dh += l1c * (tl.where(h > 0.0, 1.0, 0.0) - tl.where(h < 0.0, 1.0, 0.0))
    dg, du = grads(dh, hg, u, GATED, ACT)
    dg = tl.where(live, dg, 0.0)
    wg = tl.load(wg_ptr + n[:, None] * swg_n + ks[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
    dxa += tl.sum(dg[:, None] * wg.to(tl.float32), axis=0)
    du = tl.where(live, du, 0.0)
    if GATED:
        wu = tl.load(wu_ptr + n[:, None] * swu_n + ks[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
        dxa += tl.sum(du[:, None] * wu.to(tl.float32), axis=0)
    return dxa, dg, du, h


@triton.jit
def recompute(x_ptr, sx_m, m, w_ptr, sw_n, b_ptr, cn, c_ok, K, dt,
               HAS_B: tl.constexpr, CH: tl.constexpr, BK: tl.constexpr):
    """x[m] . W[cn] (+ b[cn]) in fp32, rounded to dt: [CH]."""
    acc = tl.zeros((CH,), dtype=tl.float32)
    kb = tl.arange(0, BK)
    for k0 in range(0, K, BK):
        kk = k0 + kb
        kmask = kk < K
        xk = tl.load(x_ptr + m * sx_m + kk, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cn[:, None] * sw_n + kk[None, :], mask=c_ok[:, None] & kmask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
    if HAS_B:
        acc += tl.load(b_ptr + cn, mask=c_ok, other=0.0).to(tl.float32)
    return acc.to(dt)


@triton.jit
def backup_rows_kernel(bidx_ptr, slot_ptr, x_ptr, sx_m, dy_ptr, sdy_m, xb_ptr, dyb_ptr, K, KO, BK: tl.constexpr,
                       ROWS: tl.constexpr):
    s = tl.program_id(0)
    r = tl.load(bidx_ptr + s).to(tl.int64)          # -1: a padding slot
    ok = r >= 0
    rr = tl.maximum(r, 0)
    if ok:
        tl.store(slot_ptr + rr, s)
    if ROWS:                                        # (False: the slots alone, for the densify backward)
        s64 = s.to(tl.int64)
        kb = tl.arange(0, BK)
        kx = tl.where(ok, K, 0)                     # columns read: none for a padding slot
        ky = tl.where(ok, KO, 0)
        for k0 in range(0, K, BK):
            kk = k0 + kb
            tl.store(xb_ptr + s64 * K + kk, tl.load(x_ptr + rr * sx_m + kk, mask=kk < kx, other=0.0), mask=kk < K)
        for k0 in range(0, KO, BK):
            kk = k0 + kb
            tl.store(dyb_ptr + s64 * KO + kk, tl.load(dy_ptr + rr * sdy_m + kk, mask=kk < ky, other=0.0),
                     mask=kk < KO)


@triton.jit
def rank_kernel(x_ptr, sx_m, dy_ptr, sdy_m, cnt_ptr, cols_ptr, W, q_ptr, rk_ptr, hist_ptr,
                blist_ptr, bctr_ptr, M, K, KO,
                BM: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    m_ok = rm < M
    kb = tl.arange(0, BK)
    nbad = tl.zeros((BM,), dtype=tl.int32)
    for k0 in range(0, K, BK):
        kk = k0 + kb
        v = tl.load(x_ptr + rm[:, None] * sx_m + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
        nbad += tl.sum(((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32), axis=1)
    for k0 in range(0, KO, BK):
        kk = k0 + kb
        v = tl.load(dy_ptr + rm[:, None] * sdy_m + kk[None, :], mask=m_ok[:, None] & (kk < KO)[None, :], other=0.0)
        nbad += tl.sum(((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32), axis=1)
    cnt = tl.load(cnt_ptr + rm, mask=m_ok, other=0)
    busy = ((cnt > W) | (nbad > 0)) & m_ok
    tl.store(q_ptr + rm, tl.where(busy, -1, cnt), mask=m_ok)
    bi = busy.to(tl.int32)
    base = tl.atomic_add(bctr_ptr, tl.sum(bi, axis=0))           # one scalar atomic per program
    tl.store(blist_ptr + base + tl.cumsum(bi, axis=0) - bi, rm.to(tl.int32), mask=busy)
    nl = tl.where(busy, 0, cnt)
    pb = tl.arange(0, BP)
    for p0 in range(0, tl.max(nl, axis=0), BP):
        p = p0 + pb
        live = p[None, :] < nl[:, None]
        sl = rm[:, None] * W + p[None, :]
        n = tl.load(cols_ptr + sl, mask=live, other=0)
        rank = tl.atomic_add(hist_ptr + n, tl.full((BM, BP), 1, tl.int32), mask=live)
        tl.store(rk_ptr + sl, rank, mask=live)


@triton.jit
def train_bwd_kernel(
    dy_ptr, sdy_m, x_ptr, sx_m, blist_ptr, bctr_ptr,
    slot_ptr, bg_ptr, bu_ptr,
    wg_ptr, swg_n, bgate_ptr, wu_ptr, swu_n, bup_ptr, wdt_ptr, swd_n,
    dx_ptr, sdx_m,
    sg_ptr, su_ptr, sh_ptr,                               # backup rows: [C, N] buffers
    mlist_ptr, mctr_ptr,                                  # other busy rows: listed
    K, N, KO, l1c, l1_ptr,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, L1: tl.constexpr,
    L1_DEV: tl.constexpr, K_P: tl.constexpr, KO_P: tl.constexpr, PAIRS: tl.constexpr, CH: tl.constexpr,
    BK: tl.constexpr, ACT: tl.constexpr,
):
    if L1_DEV:                                            # the controller's coefficient (fp32 [1])
        l1c = l1c * tl.load(l1_ptr)
    ks = tl.arange(0, K_P)
    k_ok = ks < K
    ko = tl.arange(0, KO_P)
    ko_ok = ko < KO
    dt = sh_ptr.dtype.element_ty
    pa = tl.arange(0, PAIRS)
    for i in range(tl.program_id(0), tl.load(bctr_ptr), tl.num_programs(0)):
        m = tl.load(blist_ptr + i).to(tl.int64)
        _busy_row(m, dy_ptr, sdy_m, x_ptr, sx_m, slot_ptr, bg_ptr, bu_ptr,
                  wg_ptr, swg_n, bgate_ptr, wu_ptr, swu_n, bup_ptr, wdt_ptr, swd_n, dx_ptr, sdx_m,
                  sg_ptr, su_ptr, sh_ptr, mlist_ptr, mctr_ptr, K, N, KO, l1c, ks, k_ok, ko, ko_ok, dt, pa,
                  GATED, HAS_BG, HAS_BU, L1, PAIRS, CH, BK, ACT)


@triton.jit
def _busy_row(m, dy_ptr, sdy_m, x_ptr, sx_m, slot_ptr, bg_ptr, bu_ptr,
              wg_ptr, swg_n, bgate_ptr, wu_ptr, swu_n, bup_ptr, wdt_ptr, swd_n, dx_ptr, sdx_m,
              sg_ptr, su_ptr, sh_ptr, mlist_ptr, mctr_ptr, K, N, KO, l1c, ks, k_ok, ko, ko_ok, dt, pa,
              GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, L1: tl.constexpr,
              PAIRS: tl.constexpr, CH: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr):
    """A busy row whole: its dense backup row, or g and u recomputed from x; dx written."""
    xr = tl.load(x_ptr + m * sx_m + ks, mask=k_ok, other=0.0).to(tl.float32)
    dyr = tl.load(dy_ptr + m * sdy_m + ko, mask=ko_ok, other=0.0).to(tl.float32)
    bad = (tl.sum(((xr != xr) | (tl.abs(xr) == float("inf"))).to(tl.int32), axis=0)
           + tl.sum(((dyr != dyr) | (tl.abs(dyr) == float("inf"))).to(tl.int32), axis=0)) > 0
    dxa = tl.zeros_like(xr)

    slot = tl.load(slot_ptr + m)
    ins = slot >= 0
    if not ins:
        at = tl.atomic_add(mctr_ptr, 1)                      # listed for wgrad_kernel
        tl.store(mlist_ptr + at, m.to(tl.int32))
    brow = slot.to(tl.int64) * N
    cc = tl.arange(0, CH)
    for c0 in range(0, N, CH):
        cn = c0 + cc
        c_ok = cn < N
        if ins:
            hgq = tl.load(bg_ptr + brow + cn, mask=c_ok, other=0.0)
            if GATED:
                uq = tl.load(bu_ptr + brow + cn, mask=c_ok, other=0.0)
            else:
                uq = hgq
        else:
            gq = recompute(x_ptr, sx_m, m, wg_ptr, swg_n, bgate_ptr, cn, c_ok, K, dt, HAS_BG, CH, BK)
            hgq = tl.where(gq < 0.0, 0.0, gq)                          # relu, NaN kept
            if GATED:
                uq = recompute(x_ptr, sx_m, m, wu_ptr, swu_n, bup_ptr, cn, c_ok, K, dt, HAS_BU, CH, BK)
            else:
                uq = hgq
        hgv = hgq.to(tl.float32)
        uv = uq.to(tl.float32)
        act = ((hgv != 0.0) | bad) & c_ok
        incl, na = scan(act)
        for q in range(0, na, PAIRS):
            sel, t_live, tn = select(act, incl, na, q, pa, c0, cc)
            tg = pick(sel, hgv)
            tu = pick(sel, uv)
            dxa, dg, du, h = _pairs(dxa, tn, tg, tu, t_live, dyr, wg_ptr, swg_n, wu_ptr, swu_n,
                                    wdt_ptr, swd_n, l1c, ks, k_ok, ko, ko_ok, GATED, L1, ACT)
            if ins:
                tl.store(sg_ptr + brow + tn, dg.to(dt), mask=t_live)
                tl.store(sh_ptr + brow + tn, h.to(dt), mask=t_live)
                if GATED:
                    tl.store(su_ptr + brow + tn, du.to(dt), mask=t_live)
    tl.store(dx_ptr + m * sdx_m + ks, dxa.to(dx_ptr.dtype.element_ty), mask=k_ok)


@triton.jit
def dx_rows_kernel(q_ptr, cols_ptr, eg_ptr, eu_ptr, W, wg_ptr, swg_n, wu_ptr, swu_n, dx_ptr, sdx_m, K,
                   GATED: tl.constexpr, K_P: tl.constexpr, PAIRS: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    q = tl.load(q_ptr + m)
    nl = tl.maximum(q, 0)
    ks = tl.arange(0, K_P)
    k_ok = ks < K
    pa = tl.arange(0, PAIRS)
    lrow = m * W
    dxa = tl.zeros((K_P,), dtype=tl.float32)
    live = pa < nl
    n = tl.load(cols_ptr + lrow + pa, mask=live, other=0).to(tl.int64)
    dg = tl.load(eg_ptr + lrow + pa, mask=live, other=0.0)
    du = tl.load(eu_ptr + lrow + pa, mask=live, other=0.0) if GATED else dg
    for p0 in range(0, nl, PAIRS):
        p1 = p0 + PAIRS + pa
        live1 = p1 < nl
        n1 = tl.load(cols_ptr + lrow + p1, mask=live1, other=0).to(tl.int64)
        dg1 = tl.load(eg_ptr + lrow + p1, mask=live1, other=0.0)
        du1 = tl.load(eu_ptr + lrow + p1, mask=live1, other=0.0) if GATED else dg1
        wg = tl.load(wg_ptr + n[:, None] * swg_n + ks[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
        if GATED:
            wu = tl.load(wu_ptr + n[:, None] * swu_n + ks[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
            dxa += tl.sum(dg[:, None] * wg.to(tl.float32) + du[:, None] * wu.to(tl.float32), axis=0)
        else:
            dxa += tl.sum(dg[:, None] * wg.to(tl.float32), axis=0)
        n, dg, du, live = n1, dg1, du1, live1
    tl.store(dx_ptr + m * sdx_m + ks, dxa.to(dx_ptr.dtype.element_ty), mask=tl.where(q >= 0, k_ok, False))
