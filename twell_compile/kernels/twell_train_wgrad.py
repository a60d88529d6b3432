"""Triton device code: the sparse backward's weight gradients from the quiet rows' slot values.

``scatter_kernel`` (counting sort, last step): the backward kernel counted each column's
entries (hist) and gave each entry its rank in its column (rk); with off = exclusive prefix
sum of hist, entry (m, p) of column n goes to order[off[n] + rk[m, p]] = m * W + p. No host
sync: order has the fixed size M * W.

``wgrad_kernel``: one program per neuron n, over its entries E at a time, in fp32:

    dW_g[n]   = sum d_g[e] x[m_e]        dW_u[n] = sum d_u[e] x[m_e]
    dW_d^T[n] = sum h[e] dy[m_e]         db_g[n] = sum d_g[e], db_u[n] = sum d_u[e]

plus the other rows' parts: fp32 accumulators (rows recomputed in the backward, atomics) and
the dense-backup rows' cuBLAS products (bf16 [N, K]). Rows of x and dy are gathered (4 KB each
at K=2048); neurons with no entries get exactly the other parts (zero without busy rows).
"""

import triton
import triton.language as tl


@triton.jit
def scatter_kernel(cols_ptr, rk_ptr, q_ptr, off_ptr, order_ptr, W, WP: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, WP)
    for p0 in range(0, tl.load(q_ptr + m), WP):
        pp = p0 + p
        live = pp < tl.load(q_ptr + m)
        n = tl.load(cols_ptr + m * W + pp, mask=live, other=0)
        pos = tl.load(off_ptr + n, mask=live, other=0) + tl.load(rk_ptr + m * W + pp, mask=live, other=0)
        tl.store(order_ptr + pos.to(tl.int64), (m * W + pp).to(tl.int32), mask=live)


@triton.jit
def wgrad_kernel(
    order_ptr, off_ptr, hist_ptr, W,
    eg_ptr, eu_ptr, eh_ptr, x_ptr, sx_m, dy_ptr, sdy_m,
    awg_ptr, awu_ptr, awd_ptr, abg_ptr, abu_ptr,          # fp32 parts (recomputed rows)
    bwg_ptr, bwu_ptr, bwd_ptr,                            # backup rows' products [N, K], [N, KO]
    dwg_ptr, dwu_ptr, dwd_ptr, dbg_ptr, dbu_ptr,          # outputs: [N, K], [N, K], [N, KO], fp32 [N]
    K, KO,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr,
    K_P: tl.constexpr, KO_P: tl.constexpr, E: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, K_P)
    k_ok = ks < K
    ko = tl.arange(0, KO_P)
    ko_ok = ko < KO
    start = tl.load(off_ptr + n).to(tl.int64)
    c = tl.load(hist_ptr + n)
    ea = tl.arange(0, E)
    accg = tl.zeros((K_P,), dtype=tl.float32)
    accu = tl.zeros((K_P,), dtype=tl.float32)
    accd = tl.zeros((KO_P,), dtype=tl.float32)
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
        dyt = tl.load(dy_ptr + m[:, None] * sdy_m + ko[None, :], mask=live[:, None] & ko_ok[None, :], other=0.0).to(tl.float32)
        accd += tl.sum(hv[:, None] * dyt, axis=0)
    accg += tl.load(awg_ptr + n * K + ks, mask=k_ok, other=0.0) + tl.load(bwg_ptr + n * K + ks, mask=k_ok, other=0.0).to(tl.float32)
    tl.store(dwg_ptr + n * K + ks, accg.to(dwg_ptr.dtype.element_ty), mask=k_ok)
    accd += tl.load(awd_ptr + n * KO + ko, mask=ko_ok, other=0.0) + tl.load(bwd_ptr + n * KO + ko, mask=ko_ok, other=0.0).to(tl.float32)
    tl.store(dwd_ptr + n * KO + ko, accd.to(dwd_ptr.dtype.element_ty), mask=ko_ok)
    if HAS_BG:
        tl.store(dbg_ptr + n, tl.sum(sg, axis=0) + tl.load(abg_ptr + n))
    if GATED:
        accu += tl.load(awu_ptr + n * K + ks, mask=k_ok, other=0.0) + tl.load(bwu_ptr + n * K + ks, mask=k_ok, other=0.0).to(tl.float32)
        tl.store(dwu_ptr + n * K + ks, accu.to(dwu_ptr.dtype.element_ty), mask=k_ok)
        if HAS_BU:
            tl.store(dbu_ptr + n, tl.sum(su, axis=0) + tl.load(abu_ptr + n))
