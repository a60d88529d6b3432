"""Triton device code: the split per-row TwELL path (prefill), weight slices held in L1.

The per-row kernel (twell_rows.py) gathers a whole 4 KB W_up row and W_down^T row per active
(token, neuron) pair from L2: 8 KB per pair, 3.7 GB at M=16384, 28 non-zeros per row. Here each
program keeps one narrow slice of a weight (every neuron, a few columns: <= ~180 KB) resident
in its SM's L1 and streams all tokens' pairs past it, so each weight byte leaves L2 once per
program instead of once per pair:

``split_up_kernel``: program (K slice of KS columns, range of NR neurons): for each token, its
listed pairs whose neuron is in the range (the list is in column order: a contiguous run),
the partial u over the slice, added into uacc[m, slot] (fp32 atomics, zeroed by the host).
Programs of range 0 also flag tokens whose x holds NaN/Inf (flag[m] = 1).

``split_down_kernel``: program (K_out slice of SL columns): for each token, h = g * (u + b_u)
per listed pair (h = g when not gated), y[m, slice] = sum h W_d^T[n, slice] (+ b_d), written
once; slice 0 also writes sum |h| per row.

Rows over the list width W and flagged rows are then recomputed whole by ``twell_rows_kernel``
with FIX (it rewrites their y and sum |h|): nothing is dropped.
"""

import triton
import triton.language as tl


@triton.jit
def split_up_kernel(x_ptr, sx_m, lst_ptr, cnt_ptr, wu_ptr, swu_n, uacc_ptr, flag_ptr,
                    M, K, N, W, NKS, NRANGES, TC,
                    KS: tl.constexpr, NR: tl.constexpr, BT: tl.constexpr, P: tl.constexpr,
                    LP: tl.constexpr):
    pid = tl.program_id(0)
    ksi = pid % NKS
    rest = pid // NKS
    r = rest % NRANGES
    chunk = rest // NRANGES
    k = ksi * KS + tl.arange(0, KS)
    k_ok = k < K
    n_lo = r * NR
    n_hi = n_lo + NR
    bi = tl.arange(0, BT)
    pi = tl.arange(0, P)
    li = tl.arange(0, LP)
    t_end = tl.minimum(M, (chunk + 1) * TC)
    for t0 in range(chunk * TC, t_end, BT):
        rows = t0 + bi
        r_ok = rows < t_end
        rows64 = rows.to(tl.int64)
        cnt = tl.load(cnt_ptr + rows, mask=r_ok, other=0)
        nl = tl.minimum(cnt, W)
        lrow = lst_ptr + rows64[:, None] * W
        # [lo, hi): the listed pairs whose neuron is in [n_lo, n_hi) (the list is sorted)
        lo = tl.zeros((BT,), dtype=tl.int32)
        hi = tl.zeros((BT,), dtype=tl.int32)
        for q0 in range(0, tl.max(nl, axis=0), LP):
            q = q0 + li
            ok = q[None, :] < nl[:, None]
            col = (tl.load(lrow + q[None, :], mask=ok, other=0, cache_modifier=".cg") >> 16) & 0xFFFF
            lo += tl.sum((ok & (col < n_lo)).to(tl.int32), axis=1)
            hi += tl.sum((ok & (col < n_hi)).to(tl.int32), axis=1)
        xs = tl.load(x_ptr + rows64[:, None] * sx_m + k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                     other=0.0, cache_modifier=".cg").to(tl.float32)
        if r == 0:
            bad = tl.sum(((xs != xs) | (tl.abs(xs) == float("inf"))).to(tl.int32), axis=1) > 0
            tl.store(flag_ptr + rows, tl.full((BT,), 1, tl.int32), mask=r_ok & bad)
        for p0 in range(0, tl.max(hi - lo, axis=0), P):
            idx = lo[:, None] + p0 + pi[None, :]
            live = idx < hi[:, None]
            n = ((tl.load(lrow + idx, mask=live, other=0, cache_modifier=".cg") >> 16) & 0xFFFF).to(tl.int64)
            w = tl.load(wu_ptr + n[:, :, None] * swu_n + k[None, None, :],
                        mask=live[:, :, None] & k_ok[None, None, :], other=0.0)
            part = tl.sum(w.to(tl.float32) * xs[:, None, :], axis=2)
            tl.atomic_add(uacc_ptr + rows64[:, None] * W + idx, part, mask=live, sem="relaxed")


@triton.jit
def split_down_kernel(lst_ptr, cnt_ptr, uacc_ptr, bu_ptr, wdt_ptr, swd_n, bd_ptr,
                      y_ptr, sy_m, hsum_ptr, M, KO, W, NSL, TC,
                      GATED: tl.constexpr, HAS_BU: tl.constexpr, HAS_BD: tl.constexpr,
                      SL: tl.constexpr, BT: tl.constexpr, P: tl.constexpr):
    pid = tl.program_id(0)
    s = pid % NSL
    chunk = pid // NSL
    c = s * SL + tl.arange(0, SL)
    c_ok = c < KO
    bi = tl.arange(0, BT)
    pi = tl.arange(0, P)
    if HAS_BD:
        bd = tl.load(bd_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    t_end = tl.minimum(M, (chunk + 1) * TC)
    for t0 in range(chunk * TC, t_end, BT):
        rows = t0 + bi
        r_ok = rows < t_end
        rows64 = rows.to(tl.int64)
        nl = tl.minimum(tl.load(cnt_ptr + rows, mask=r_ok, other=0), W)
        acc = tl.zeros((BT, SL), dtype=tl.float32)
        hs = tl.zeros((BT,), dtype=tl.float32)
        for p0 in range(0, tl.max(nl, axis=0), P):
            idx = p0 + pi
            live = idx[None, :] < nl[:, None]
            off = rows64[:, None] * W + idx[None, :]
            pk = tl.load(lst_ptr + off, mask=live, other=0, cache_modifier=".cg")
            n = ((pk >> 16) & 0xFFFF).to(tl.int64)
            g = (pk & 0xFFFF).to(tl.int16).to(wdt_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
            if GATED:
                u = tl.load(uacc_ptr + off, mask=live, other=0.0, cache_modifier=".cg")
                if HAS_BU:
                    u += tl.load(bu_ptr + n, mask=live, other=0.0).to(tl.float32)
                h = g * u
            else:
                h = g
            h = tl.where(live, h, 0.0)
            w = tl.load(wdt_ptr + n[:, :, None] * swd_n + c[None, None, :],
                        mask=live[:, :, None] & c_ok[None, None, :], other=0.0)
            acc += tl.sum(h[:, :, None] * w.to(tl.float32), axis=1)
            hs += tl.sum(tl.abs(h), axis=1)
        if HAS_BD:
            acc += bd[None, :]
        tl.store(y_ptr + rows64[:, None] * sy_m + c[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & c_ok[None, :])
        tl.store(hsum_ptr + rows, hs, mask=r_ok & ((bi * 0 + s) == 0))
