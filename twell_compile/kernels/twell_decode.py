"""Triton device code: the decode path (few tokens, M <= 64), three launches, no atomics.

At decode sizes the FFN is memory-bound: dense reads W_gate, W_up and W_down in full. Here only
W_gate is read in full; W_up rows and W_down^T rows ([N, K_out] layout, made once per weight by
``weight_cache``) are read for the union of active neurons over the M rows only.

``decode_gate_kernel`` (grid: N / BN neuron blocks):
  g = x W_g[block]^T (+ b_g) for all M rows (tl.dot, M padded to M_P >= 16, loop over K),
  rounded to x's dtype as eager's GEMM output is; v = relu(g) (NaN kept). A column is active
  when any row has v != 0 (NaN counts); if any x row holds NaN/Inf every column is active, so
  the result equals dense (0 * Inf = NaN). Then, only if the block has an active column,
  u = x W_u[active rows]^T (+ b_u): masked-off rows are never fetched. h = v * u in fp32,
  stored in x's dtype to h [M, N] (zeros for inactive columns). Also per (block, row) the
  non-zero count of v, and per block sum |h|.
``decode_down_kernel`` (grid: K_out / BKO chunks x N / NS splits):
  partial[s] = h[:, split s] @ W_d^T[split s rows, chunk] over CH-column steps; a W_d^T row is
  loaded only where some row of h is non-zero in that column.
``decode_finish_kernel``: y = sum_s partial[s] + b_d, cast; one extra program sums the
  per-block counts into non-zeros per token (and their total, for the density policy) and
  the per-block |h| sums.
Deterministic: fixed reduction order, no atomics, no zero-initialised buffers.
"""

import triton
import triton.language as tl


@triton.jit
def decode_gate_kernel(
    x_ptr, sx_m, sx_k,
    wg_ptr, swg_n, swg_k, bg_ptr,
    wu_ptr, swu_n, swu_k, bu_ptr,
    h_ptr, sh_m, cnt_ptr, hs_ptr,
    M, K, N,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr,
    M_P: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    n_ok = rn < N
    rm = tl.arange(0, M_P)
    m_ok = rm < M
    rk = tl.arange(0, BK)
    xbase = x_ptr + rm.to(tl.int64)[:, None] * sx_m
    dt = x_ptr.dtype.element_ty

    acc = tl.zeros((M_P, BN), dtype=tl.float32)
    nonfin = tl.zeros((M_P,), dtype=tl.float32)        # sum of x * 0: NaN iff a NaN/Inf entry
    wg_base = wg_ptr + rn.to(tl.int64)[:, None] * swg_n
    for k0 in range(0, K, BK):
        kk = k0 + rk
        k_ok = kk < K
        xk = tl.load(xbase + kk[None, :] * sx_k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(wg_base + kk[None, :] * swg_k, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(xk, tl.trans(w), acc)
        nonfin += tl.sum(xk.to(tl.float32) * 0.0, axis=1)
    if HAS_BG:
        acc += tl.load(bg_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    g = acc.to(dt).to(tl.float32)                          # eager's rounding of the GEMM output
    v = tl.where(g < 0.0, 0.0, g)                          # relu, NaN kept
    valid = m_ok[:, None] & n_ok[None, :]
    nz = (v != 0.0) & valid                                # NaN != 0: counted
    bad = nonfin != nonfin
    act = nz | (bad[:, None] & valid)
    col = tl.max(act.to(tl.int32), axis=0) > 0             # [BN]: any row active
    if GATED:
        u = tl.zeros((M_P, BN), dtype=tl.float32)
        if tl.sum(col.to(tl.int32), axis=0) > 0:
            wu_base = wu_ptr + rn.to(tl.int64)[:, None] * swu_n
            for k0 in range(0, K, BK):
                kk = k0 + rk
                k_ok = kk < K
                xk = tl.load(xbase + kk[None, :] * sx_k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(wu_base + kk[None, :] * swu_k, mask=col[:, None] & k_ok[None, :], other=0.0)
                u = tl.dot(xk, tl.trans(w), u)
            if HAS_BU:
                u += tl.load(bu_ptr + rn, mask=col, other=0.0).to(tl.float32)[None, :]
        h = v * u
    else:
        h = v
    h = tl.where(valid, h, 0.0)
    tl.store(h_ptr + rm.to(tl.int64)[:, None] * sh_m + rn[None, :], h.to(dt), mask=valid)
    tl.store(cnt_ptr + pid * M + rm, tl.sum(nz.to(tl.int32), axis=1), mask=m_ok)
    tl.store(hs_ptr + pid, tl.sum(tl.sum(tl.abs(h), axis=1), axis=0))


@triton.jit
def decode_down_kernel(
    h_ptr, sh_m, wdt_ptr, swd_n, swd_k, part_ptr,
    M, N, KO, NS,
    M_P: tl.constexpr, CH: tl.constexpr, BKO: tl.constexpr,
):
    pko = tl.program_id(0)
    ps = tl.program_id(1)
    ko = pko * BKO + tl.arange(0, BKO)
    ko_ok = ko < KO
    rm = tl.arange(0, M_P)
    m_ok = rm < M
    cc = tl.arange(0, CH)
    hbase = h_ptr + rm.to(tl.int64)[:, None] * sh_m
    acc = tl.zeros((M_P, BKO), dtype=tl.float32)
    n_lo = ps * NS
    n_hi = tl.minimum(n_lo + NS, N)
    for c0 in range(n_lo, n_hi, CH):
        cn = c0 + cc
        c_ok = cn < n_hi
        hv = tl.load(hbase + cn[None, :], mask=m_ok[:, None] & c_ok[None, :], other=0.0)
        col = tl.max((hv != 0.0).to(tl.int32), axis=0) > 0  # NaN != 0: kept
        w = tl.load(wdt_ptr + cn.to(tl.int64)[:, None] * swd_n + ko[None, :] * swd_k,
                    mask=col[:, None] & ko_ok[None, :], other=0.0)
        acc = tl.dot(hv, w, acc)
    tl.store(part_ptr + (ps * M + rm)[:, None] * KO + ko[None, :], acc,
             mask=m_ok[:, None] & ko_ok[None, :])


@triton.jit
def decode_finish_kernel(
    part_ptr, bd_ptr, y_ptr, sy_m, sy_k,
    cnt_ptr, hs_ptr, tok_ptr, hsum_ptr,
    M, KO, S, NB,
    HAS_BD: tl.constexpr, S_P: tl.constexpr, BLOCK: tl.constexpr,
    M_P: tl.constexpr, NB_CH: tl.constexpr,
):
    pid = tl.program_id(0)
    n_y = tl.cdiv(M * KO, BLOCK)
    if pid < n_y:
        idx = pid * BLOCK + tl.arange(0, BLOCK)
        ok = idx < M * KO
        ss = tl.arange(0, S_P)
        p = tl.load(part_ptr + ss.to(tl.int64)[:, None] * (M * KO) + idx[None, :],
                    mask=(ss < S)[:, None] & ok[None, :], other=0.0)
        acc = tl.sum(p, axis=0)
        m = idx // KO
        ko = idx % KO
        if HAS_BD:
            acc += tl.load(bd_ptr + ko, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + m.to(tl.int64) * sy_m + ko * sy_k, acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        # non-zeros per token (tok[:M]), their total (tok[M]) and sum |h|
        rm = tl.arange(0, M_P)
        m_ok = rm < M
        bb0 = tl.arange(0, NB_CH)
        tot = tl.zeros((M_P,), dtype=tl.int32)
        hs = tl.zeros((NB_CH,), dtype=tl.float32)
        for b0 in range(0, NB, NB_CH):
            bb = b0 + bb0
            b_ok = bb < NB
            c = tl.load(cnt_ptr + bb[:, None] * M + rm[None, :], mask=b_ok[:, None] & m_ok[None, :], other=0)
            tot += tl.sum(c, axis=0)
            hs += tl.load(hs_ptr + bb, mask=b_ok, other=0.0)
        tl.store(tok_ptr + rm, tot, mask=m_ok)
        tl.store(tok_ptr + M, tl.sum(tot, axis=0))
        tl.store(hsum_ptr, tl.sum(hs, axis=0))
