"""Triton device code: the training backward's per-row kernel (sparse path).

One program per token row m, dy row and the dx accumulator in registers. For every active
(m, n) pair, with h_g = relu(g) and u as saved:

    dh  = dy[m] . W_d^T[n]               (+ l1c * sgn(h) with L1)
    d_g = dh * u * [not h_g <= 0]        (non-gated: dh * [...]; NaN passes, as threshold_backward)
    d_u = dh * h_g
    dx[m] += d_g * W_g[n] + d_u * W_u[n]

and d_g, d_u, h = h_g * u are written into zero-filled dense [M, N] buffers for the weight
gradients (cuBLAS products with x and dy on the host side).

Where the active pairs come from:
  * quiet rows (count <= W, finite x): the ELL slots.
  * busy rows in the dense backup (slot_of[m] >= 0): the backup row, scanned CH columns at a
    time, its non-zeros picked with a prefix count (as twell_rows' tail).
  * busy rows past the backup: g (and u) recomputed from x, CH columns x BK of K per step, in
    fp32 rounded to the dtype (as cuBLAS rounds its output), then scanned the same way.
  * rows with non-finite x: every column, so NaN/Inf spread as in dense autograd.
A non-finite dy row in a gated FFN makes d_u NaN on the whole row (dense: NaN * 0).
"""

import triton
import triton.language as tl


@triton.jit
def _pairs(dxa, m, n, hg, u, live, dyr, wg_ptr, swg_n, wu_ptr, swu_n, wdt_ptr, swd_n,
           dg_ptr, du_ptr, h_ptr, N, l1c, ks, k_ok, ko, ko_ok,
           GATED: tl.constexpr, L1: tl.constexpr):
    """dx += d_g W_g[n] + d_u W_u[n] for PAIRS pairs; writes d_g, d_u, h at (m, n)."""
    dt = h_ptr.dtype.element_ty
    wd = tl.load(wdt_ptr + n[:, None] * swd_n + ko[None, :], mask=live[:, None] & ko_ok[None, :], other=0.0)
    dh = tl.sum(wd.to(tl.float32) * dyr[None, :], axis=1)
    h = hg * u if GATED else hg
    if L1:
        dh += l1c * (tl.where(h > 0.0, 1.0, 0.0) - tl.where(h < 0.0, 1.0, 0.0))
    dg = tl.where(live & (hg <= 0.0), 0.0, dh * u if GATED else dh)   # threshold_backward: NaN passes
    dg = tl.where(live, dg, 0.0)
    wg = tl.load(wg_ptr + n[:, None] * swg_n + ks[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
    dxa += tl.sum(dg[:, None] * wg.to(tl.float32), axis=0)
    off = m * N + n
    tl.store(dg_ptr + off, dg.to(dt), mask=live)
    tl.store(h_ptr + off, h.to(dt), mask=live)
    if GATED:
        du = tl.where(live, dh * hg, 0.0)
        wu = tl.load(wu_ptr + n[:, None] * swu_n + ks[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
        dxa += tl.sum(du[:, None] * wu.to(tl.float32), axis=0)
        tl.store(du_ptr + off, du.to(dt), mask=live)
    return dxa


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
    dx_ptr, sdx_m, dg_ptr, du_ptr, h_ptr,
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
    dt = h_ptr.dtype.element_ty
    xr = tl.load(x_ptr + m * sx_m + ks, mask=k_ok, other=0.0).to(tl.float32)
    bad = tl.sum(((xr != xr) | (tl.abs(xr) == float("inf"))).to(tl.int32), axis=0) > 0
    dyr = tl.load(dy_ptr + m * sdy_m + ko, mask=ko_ok, other=0.0).to(tl.float32)
    bad_dy = tl.sum(((dyr != dyr) | (tl.abs(dyr) == float("inf"))).to(tl.int32), axis=0) > 0
    cnt = tl.load(cnt_ptr + m)
    busy = (cnt > W) | bad
    nl = tl.where(busy, 0, cnt)
    pa = tl.arange(0, PAIRS)
    dxa = tl.zeros((K_P,), dtype=tl.float32)
    lrow = m * W

    # 1. quiet rows: the ELL slots
    for p0 in range(0, nl, PAIRS):
        p = p0 + pa
        live = p < nl
        n = tl.load(cols_ptr + lrow + p, mask=live, other=0).to(tl.int64)
        hg = tl.load(ellg_ptr + lrow + p, mask=live, other=0.0).to(tl.float32)
        if GATED:
            u = tl.load(ellu_ptr + lrow + p, mask=live, other=0.0).to(tl.float32)
        else:
            u = hg
        dxa = _pairs(dxa, m, n, hg, u, live, dyr, wg_ptr, swg_n, wu_ptr, swu_n, wdt_ptr, swd_n,
                     dg_ptr, du_ptr, h_ptr, N, l1c, ks, k_ok, ko, ko_ok, GATED, L1)

    # 2. busy rows: the dense backup row, or g and u recomputed from x
    slot = tl.load(slot_ptr + m)
    ins = slot >= 0
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
            dxa = _pairs(dxa, m, tn, tg, tu, t_live, dyr, wg_ptr, swg_n, wu_ptr, swu_n, wdt_ptr, swd_n,
                         dg_ptr, du_ptr, h_ptr, N, l1c, ks, k_ok, ko, ko_ok, GATED, L1)

    # 3. non-finite dy, gated: d_u = dh * h_g is NaN on the whole row in dense autograd
    if GATED:
        nan_row = bad_dy & (N > 0)
        dxa = tl.where(nan_row, float("nan"), dxa)
        for c0 in range(0, tl.where(nan_row, N, 0), CH):
            cn = c0 + cc
            tl.store(du_ptr + m * N + cn, tl.full((CH,), float("nan"), tl.float32).to(dt), mask=cn < N)
    tl.store(dx_ptr + m * sdx_m + ks, dxa.to(dx_ptr.dtype.element_ty), mask=k_ok)
