"""Triton device code: the training backward's per-row kernel (sparse path).

One program per token row m, dy row and the dx accumulator in registers. For every active
(m, n) pair, with h_g = relu(g) and u as saved:

    dh  = dy[m] . W_d^T[n]               (+ l1c * sgn(h) with L1)
    d_g = dh * u * [not h_g <= 0]        (non-gated: dh * [...]; NaN passes, as threshold_backward)
    d_u = dh * h_g,  h = h_g * u
    dx[m] += d_g * W_g[n] + d_u * W_u[n]

Rows, and where (d_g, d_u, h) go for the weight gradients:
  * quiet rows (count <= W, finite x and dy): the ELL slots; values written at the same slots
    (eg, eu, eh), the column's running count taken with an atomic on hist[n] and its old value
    (the entry's rank in its column, for the counting sort) written to rk. q[m] = count.
  * busy rows in the dense backup (slot_of[m] >= 0): the backup row scanned CH columns at a
    time, non-zeros picked with a prefix count (as twell_rows' tail); values into row ``slot``
    of zero-filled [C, N] buffers (cuBLAS products with the gathered x / dy rows). q[m] = 0.
  * other busy rows (past the backup, or non-finite dy): g and u recomputed from x, CH columns
    x BK of K per step, fp32 rounded to the dtype (as cuBLAS rounds), for dx; the row is
    appended to mlist (atomic counter) and wgrad_kernel recomputes its weight-gradient terms
    per neuron. q[m] = 0. Rare by design (slow, exact).
Rows with non-finite x or dy take every column, so NaN/Inf spread as in dense autograd
(d_u = NaN * 0 on the whole row of a non-finite dy, 0 * NaN in the products with x).
"""

import triton
import triton.language as tl


@triton.jit
def _pairs(dxa, n, hg, u, live, dyr, wg_ptr, swg_n, wu_ptr, swu_n, wdt_ptr, swd_n,
           l1c, ks, k_ok, ko, ko_ok, GATED: tl.constexpr, L1: tl.constexpr):
    """dx += d_g W_g[n] + d_u W_u[n] for PAIRS pairs; returns (dx, d_g, d_u, h) in fp32."""
    wd = tl.load(wdt_ptr + n[:, None] * swd_n + ko[None, :], mask=live[:, None] & ko_ok[None, :], other=0.0)
    dh = tl.sum(wd.to(tl.float32) * dyr[None, :], axis=1)
    h = hg * u if GATED else hg
    if L1:
        dh += l1c * (tl.where(h > 0.0, 1.0, 0.0) - tl.where(h < 0.0, 1.0, 0.0))
    dg = tl.where(hg <= 0.0, 0.0, dh * u if GATED else dh)
    dg = tl.where(live, dg, 0.0)
    wg = tl.load(wg_ptr + n[:, None] * swg_n + ks[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
    dxa += tl.sum(dg[:, None] * wg.to(tl.float32), axis=0)
    du = tl.where(live, dh * hg, 0.0)
    if GATED:
        wu = tl.load(wu_ptr + n[:, None] * swu_n + ks[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
        dxa += tl.sum(du[:, None] * wu.to(tl.float32), axis=0)
    return dxa, dg, du, h


@triton.jit
def _recompute(x_ptr, sx_m, m, w_ptr, sw_n, b_ptr, cn, c_ok, K, dt,
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
def train_bwd_kernel(
    dy_ptr, sdy_m, x_ptr, sx_m, cnt_ptr, cols_ptr, ellg_ptr, ellu_ptr, W,
    slot_ptr, bg_ptr, bu_ptr,
    wg_ptr, swg_n, bgate_ptr, wu_ptr, swu_n, bup_ptr, wdt_ptr, swd_n,
    dx_ptr, sdx_m,
    eg_ptr, eu_ptr, eh_ptr, rk_ptr, q_ptr, hist_ptr,      # quiet rows: per-slot values, ranks
    sg_ptr, su_ptr, sh_ptr,                               # backup rows: [C, N] buffers
    mlist_ptr, mctr_ptr,                                  # other busy rows: listed
    K, N, KO, l1c,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, L1: tl.constexpr,
    K_P: tl.constexpr, KO_P: tl.constexpr, PAIRS: tl.constexpr, CH: tl.constexpr,
    BK: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, K_P)
    k_ok = ks < K
    ko = tl.arange(0, KO_P)
    ko_ok = ko < KO
    dt = eh_ptr.dtype.element_ty
    xr = tl.load(x_ptr + m * sx_m + ks, mask=k_ok, other=0.0).to(tl.float32)
    dyr = tl.load(dy_ptr + m * sdy_m + ko, mask=ko_ok, other=0.0).to(tl.float32)
    bad = (tl.sum(((xr != xr) | (tl.abs(xr) == float("inf"))).to(tl.int32), axis=0)
           + tl.sum(((dyr != dyr) | (tl.abs(dyr) == float("inf"))).to(tl.int32), axis=0)) > 0
    cnt = tl.load(cnt_ptr + m)
    busy = (cnt > W) | bad
    nl = tl.where(busy, 0, cnt)
    tl.store(q_ptr + m, nl)
    pa = tl.arange(0, PAIRS)
    dxa = tl.zeros((K_P,), dtype=tl.float32)
    lrow = m * W

    # 1. quiet rows: the ELL slots
    live = pa < nl
    n = tl.load(cols_ptr + lrow + pa, mask=live, other=0).to(tl.int64)
    hg = tl.load(ellg_ptr + lrow + pa, mask=live, other=0.0).to(tl.float32)
    u = tl.load(ellu_ptr + lrow + pa, mask=live, other=0.0).to(tl.float32) if GATED else hg
    for p0 in range(0, nl, PAIRS):
        p = p0 + pa
        live1 = (p + PAIRS) < nl                # next slots' (col, h_g, u), one step ahead
        n1 = tl.load(cols_ptr + lrow + p + PAIRS, mask=live1, other=0).to(tl.int64)
        hg1 = tl.load(ellg_ptr + lrow + p + PAIRS, mask=live1, other=0.0).to(tl.float32)
        u1 = tl.load(ellu_ptr + lrow + p + PAIRS, mask=live1, other=0.0).to(tl.float32) if GATED else hg1
        dxa, dg, du, h = _pairs(dxa, n, hg, u, live, dyr, wg_ptr, swg_n, wu_ptr, swu_n, wdt_ptr, swd_n,
                                l1c, ks, k_ok, ko, ko_ok, GATED, L1)
        tl.store(eg_ptr + lrow + p, dg.to(dt), mask=live)
        tl.store(eh_ptr + lrow + p, h.to(dt), mask=live)
        if GATED:
            tl.store(eu_ptr + lrow + p, du.to(dt), mask=live)
        rank = tl.atomic_add(hist_ptr + n, tl.full((PAIRS,), 1, tl.int32), mask=live)
        tl.store(rk_ptr + lrow + p, rank, mask=live)
        n, hg, u, live = n1, hg1, u1, live1

    # 2. busy rows: the dense backup row, or g and u recomputed from x
    slot = tl.load(slot_ptr + m)
    ins = slot >= 0
    lost = busy & (~ins)
    at = tl.atomic_add(mctr_ptr, 1, mask=lost)              # listed for wgrad_kernel
    tl.store(mlist_ptr + tl.where(lost, at, 0), m.to(tl.int32), mask=lost)
    brow = slot.to(tl.int64) * N
    cc = tl.arange(0, CH)
    for c0 in range(tl.where(busy, 0, N), N, CH):
        cn = c0 + cc
        c_ok = cn < N
        if ins:
            hgq = tl.load(bg_ptr + brow + cn, mask=c_ok, other=0.0)
            if GATED:
                uq = tl.load(bu_ptr + brow + cn, mask=c_ok, other=0.0)
            else:
                uq = hgq
        else:
            gq = _recompute(x_ptr, sx_m, m, wg_ptr, swg_n, bgate_ptr, cn, c_ok, K, dt, HAS_BG, CH, BK)
            hgq = tl.where(gq < 0.0, 0.0, gq)                          # relu, NaN kept
            if GATED:
                uq = _recompute(x_ptr, sx_m, m, wu_ptr, swu_n, bup_ptr, cn, c_ok, K, dt, HAS_BU, CH, BK)
            else:
                uq = hgq
        hgv = hgq.to(tl.float32)
        uv = uq.to(tl.float32)
        act = ((hgv != 0.0) | bad) & c_ok
        ai = act.to(tl.int32)
        incl = tl.cumsum(ai, axis=0)
        na = tl.sum(ai, axis=0)
        for q in range(0, na, PAIRS):
            j = q + pa + 1
            sel = act[None, :] & (incl[None, :] == j[:, None])       # [PAIRS, CH]: the j-th active
            t_live = j <= na
            tn = (c0 + tl.sum(tl.where(sel, cc[None, :], 0), axis=1)).to(tl.int64)
            tg = tl.sum(tl.where(sel, hgv[None, :], 0.0), axis=1)
            tu = tl.sum(tl.where(sel, uv[None, :], 0.0), axis=1)
            dxa, dg, du, h = _pairs(dxa, tn, tg, tu, t_live, dyr, wg_ptr, swg_n, wu_ptr, swu_n,
                                    wdt_ptr, swd_n, l1c, ks, k_ok, ko, ko_ok, GATED, L1)
            if ins:
                tl.store(sg_ptr + brow + tn, dg.to(dt), mask=t_live)
                tl.store(sh_ptr + brow + tn, h.to(dt), mask=t_live)
                if GATED:
                    tl.store(su_ptr + brow + tn, du.to(dt), mask=t_live)
    tl.store(dx_ptr + m * sdx_m + ks, dxa.to(dx_ptr.dtype.element_ty), mask=k_ok)
