"""Triton device code: the sparse backward's weight gradients.

``scatter_kernel`` (counting sort, last step): the backward kernel counted each column's
entries (hist) and gave each entry its rank in its column (rk); with off = exclusive prefix
sum of hist, entry (m, p) of column n goes to order[off[n] + rk[m, p]] = m * W + p. No host
sync: order has the fixed size M * W.

``wgrad_kernel``: one program per (neuron n, chunk of BKW columns of K and of K_out), fp32:

    dW_g[n]   = sum d_g[e] x[m_e]        dW_u[n] = sum d_u[e] x[m_e]
    dW_d^T[n] = sum h[e] dy[m_e]         db_g[n] = sum d_g[e], db_u[n] = sum d_u[e]

over the quiet rows' entries of n (E at a time, x and dy rows gathered), plus the rows listed
in mlist (busy rows past the dense backup, rows with non-finite dy): their g, u, dh at n are
recomputed from x, dy and the weight rows (full dot products; slow, exact, rare). The dense
backup rows' part is already in the outputs (cuBLAS products written there first), so a
neuron with no entries keeps exactly that part.

The [E, BKW] tiles must lie along K inside each warp (BKW >= 256 x warps): the sums over the E
entries then stay in registers. Compiled for sm_90 (Triton 3.9, CPU-side check of the TTGIR):
BKW 2048 / E 4 / 4 warps gives warpsPerCTA [1, 4] and 6 bar.sync in the kernel; BKW 256 / 4
warps gives warpsPerCTA [4, 1] (warps along E) and 42 bar.sync, BKW 128 / 2 warps 30. H200,
M=16384, d=0.005: the chunked layouts took 3.7-12.8 ms for this kernel (run 3 profile); the
whole-row layout about 1 ms, by difference (run 2: whole backward 2.66 ms with it, the per-row
kernel ~1.5 ms). BKW 256 with 1 warp also keeps warps along K (0 bar.sync); not timed."""

import triton
import triton.language as tl


@triton.jit
def scatter_kernel(cols_ptr, rk_ptr, q_ptr, off_ptr, order_ptr, W, WP: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, WP)
    q = tl.load(q_ptr + m)
    for p0 in range(0, q, WP):
        pp = p0 + p
        live = pp < q
        n = tl.load(cols_ptr + m * W + pp, mask=live, other=0)
        pos = tl.load(off_ptr + n, mask=live, other=0) + tl.load(rk_ptr + m * W + pp, mask=live, other=0)
        tl.store(order_ptr + pos.to(tl.int64), (m * W + pp).to(tl.int32), mask=live)


@triton.jit
def _dot(a_ptr, b_ptr, L, BKW: tl.constexpr):
    """sum a[:L] * b[:L] in fp32 (rows of length L)."""
    kb = tl.arange(0, BKW)
    acc = tl.zeros((BKW,), dtype=tl.float32)
    for k0 in range(0, L, BKW):
        kk = k0 + kb
        ok = kk < L
        acc += tl.load(a_ptr + kk, mask=ok, other=0.0).to(tl.float32) * tl.load(b_ptr + kk, mask=ok, other=0.0).to(tl.float32)
    return tl.sum(acc, axis=0)


@triton.jit
def wgrad_kernel(
    order_ptr, off_ptr, hist_ptr, W,
    eg_ptr, eu_ptr, eh_ptr, x_ptr, sx_m, dy_ptr, sdy_m,
    mlist_ptr, mctr_ptr, wg_ptr, swg_n, bgate_ptr, wu_ptr, swu_n, bup_ptr, wdt_ptr, swd_n, l1c,
    dwg_ptr, dwu_ptr, dwd_ptr, dbg_ptr, dbu_ptr,   # [N, K], [N, K], [N, KO] (backup part in), fp32 [N]
    K, KO,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, L1: tl.constexpr,
    BKW: tl.constexpr, E: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    ks = j * BKW + tl.arange(0, BKW)
    k_ok = ks < K
    ko_ok = ks < KO
    dt = dwg_ptr.dtype.element_ty
    start = tl.load(off_ptr + n).to(tl.int64)
    c = tl.load(hist_ptr + n)
    ea = tl.arange(0, E)
    accg = tl.zeros((BKW,), dtype=tl.float32)
    accu = tl.zeros((BKW,), dtype=tl.float32)
    accd = tl.zeros((BKW,), dtype=tl.float32)
    sg = tl.zeros((E,), dtype=tl.float32)
    su = tl.zeros((E,), dtype=tl.float32)
    for e0 in range(0, c, E):
        e = e0 + ea
        live = e < c
        idx = tl.load(order_ptr + start + e, mask=live, other=0).to(tl.int64)
        m = idx // W
        dg = tl.load(eg_ptr + idx, mask=live, other=0.0).to(tl.float32)
        hv = tl.load(eh_ptr + idx, mask=live, other=0.0).to(tl.float32)
        xt = tl.load(x_ptr + m[:, None] * sx_m + ks[None, :], mask=live[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        accg += tl.sum(dg[:, None] * xt, axis=0)
        sg += dg
        if GATED:
            du = tl.load(eu_ptr + idx, mask=live, other=0.0).to(tl.float32)
            accu += tl.sum(du[:, None] * xt, axis=0)
            su += du
        dyt = tl.load(dy_ptr + m[:, None] * sdy_m + ks[None, :], mask=live[:, None] & ko_ok[None, :], other=0.0).to(tl.float32)
        accd += tl.sum(hv[:, None] * dyt, axis=0)
    # rows listed by the backward kernel: recompute g, u, dh at (m, n)
    sgm = tl.zeros((E,), dtype=tl.float32)       # bias sums of the listed rows (lane 0)
    sum_ = tl.zeros((E,), dtype=tl.float32)
    for i in range(0, tl.load(mctr_ptr)):
        m = tl.load(mlist_ptr + i).to(tl.int64)
        g = _dot(wg_ptr + n * swg_n, x_ptr + m * sx_m, K, BKW)
        if HAS_BG:
            g += tl.load(bgate_ptr + n).to(tl.float32)
        g = g.to(dt).to(tl.float32)
        hg = tl.where(g < 0.0, 0.0, g)
        if GATED:
            u = _dot(wu_ptr + n * swu_n, x_ptr + m * sx_m, K, BKW)
            if HAS_BU:
                u += tl.load(bup_ptr + n).to(tl.float32)
            u = u.to(dt).to(tl.float32)
            h = hg * u
        else:
            u = hg
            h = hg
        dh = _dot(wdt_ptr + n * swd_n, dy_ptr + m * sdy_m, KO, BKW)
        if L1:
            dh += l1c * (tl.where(h > 0.0, 1.0, 0.0) - tl.where(h < 0.0, 1.0, 0.0))
        dgm = tl.where(hg <= 0.0, 0.0, dh * u if GATED else dh)
        xm = tl.load(x_ptr + m * sx_m + ks, mask=k_ok, other=0.0).to(tl.float32)
        accg += dgm * xm
        accd += h.to(dt).to(tl.float32) * tl.load(dy_ptr + m * sdy_m + ks, mask=ko_ok, other=0.0).to(tl.float32)
        sgm += tl.where(ea == 0, dgm, 0.0)
        if GATED:
            dum = dh * hg
            accu += dum * xm
            sum_ += tl.where(ea == 0, dum, 0.0)
    accg += tl.load(dwg_ptr + n * K + ks, mask=k_ok, other=0.0).to(tl.float32)
    tl.store(dwg_ptr + n * K + ks, accg.to(dt), mask=k_ok)
    accd += tl.load(dwd_ptr + n * KO + ks, mask=ko_ok, other=0.0).to(tl.float32)
    tl.store(dwd_ptr + n * KO + ks, accd.to(dt), mask=ko_ok)
    if GATED:
        accu += tl.load(dwu_ptr + n * K + ks, mask=k_ok, other=0.0).to(tl.float32)
        tl.store(dwu_ptr + n * K + ks, accu.to(dt), mask=k_ok)
    if j == 0:
        if HAS_BG:
            tl.store(dbg_ptr + n, tl.sum(sg + sgm, axis=0))
        if HAS_BU:
            tl.store(dbu_ptr + n, tl.sum(su + sum_, axis=0))
