"""Triton device code: the decode path (few tokens, M <= 64).

At decode sizes the FFN is memory-bound: dense reads W_gate, W_up and W_down in full. Here
W_gate is read in full, W_up rows and W_down^T rows ([N, K_out] layout, made once per weight by
``weight_cache``) only for neurons active in at least one row of the row block. Rows are
padded to MB >= 16 (tl.dot's minimum) and split in row blocks of MB <= 32.

``decode_gate_up_kernel`` (grid: N / BN neuron blocks x KS splits of K x row blocks):
  g = x W_g^T + b_g for BN neurons (fp32, tl.dot over K). With KS > 1 each program stores its
  fp32 partial, and the block's last program to take a ticket (an acq_rel atomic after a
  barrier) sums the KS partials in order and goes on alone: more programs in flight for the
  W_gate read, one launch. v = relu(g) (NaN kept). A neuron is
  active when some row has v != 0 or a non-finite g: a row of x holding NaN/Inf makes every g
  of that row NaN/Inf (0 * Inf = NaN in the dot), so such rows activate every neuron and the
  result propagates as dense's 0 * Inf does, with no separate check of x. Blocks with an
  active neuron then run u = x W_u[active]^T (+ b_u), masked loads: inactive W_u rows never
  leave memory. h = v * u, rounded to x's dtype as eager rounds h for the down GEMM, is
  appended with the neuron index to the row block's list (slots from an atomic counter).
  Statistics: non-zeros per token, their total (the policy's probe) and sum |h|, by atomics.
``decode_down_kernel`` (grid: K_out / BKO x S list splits x row blocks):
  y[:, block] = sum over the list of h[:, e] W_d^T[n_e, block], E entries per tl.dot; with
  S == 1 it adds b_d and writes y, else fp32 partials that ``decode_sum_kernel`` adds.
Sums over the list run in the order the blocks took their slots: the last bits of y vary
between runs (fp32 sums in varying order); the error bound does not.
"""

import triton
import triton.language as tl


@triton.jit
def decode_gate_up_kernel(
    x_ptr, sx_m, sx_k, wg_ptr, swg_n, swg_k, bg_ptr, wu_ptr, swu_n, swu_k, bu_ptr,
    idx_ptr, hl_ptr, ib_ptr, hs_ptr, gp_ptr, tk_ptr,
    M, K, N, KSL,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr,
    MB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_r = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    rm = pid_r * MB + tl.arange(0, MB)
    m_ok = rm < M
    valid = m_ok[:, None] & n_ok[None, :]
    rk = tl.arange(0, BK)
    xbase = x_ptr + rm.to(tl.int64)[:, None] * sx_m
    wg_base = wg_ptr + rn.to(tl.int64)[:, None] * swg_n
    k_lo = pid_s * KSL
    k_hi = tl.minimum(K, k_lo + KSL)
    acc = tl.zeros((MB, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + rk
        k_ok = kk < k_hi
        xk = tl.load(xbase + kk[None, :] * sx_k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(wg_base + kk[None, :] * swg_k, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(xk, tl.trans(w), acc)
    if KS > 1:
        # split K: fp32 partials, and the block's last program to finish (ticket) goes on
        gp = gp_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(gp + pid_s * M * N, acc, mask=valid)
        tl.debug_barrier()
        ticket = tl.atomic_add(tk_ptr + pid_r * tl.num_programs(0) + pid_n, 1, sem="acq_rel")
        if ticket == KS - 1:
            acc = tl.zeros((MB, BN), dtype=tl.float32)
            for s in tl.static_range(KS):
                acc += tl.load(gp + s * M * N, mask=valid, other=0.0, cache_modifier=".cg")
            _gate_epilogue(acc, x_ptr, sx_k, bg_ptr, wu_ptr, swu_n, swu_k, bu_ptr, idx_ptr, hl_ptr, ib_ptr, hs_ptr,
                           M, K, N, pid_r, rn, n_ok, rm, m_ok, valid, xbase, rk,
                           GATED, HAS_BG, HAS_BU, MB, BN, BK)
    else:
        _gate_epilogue(acc, x_ptr, sx_k, bg_ptr, wu_ptr, swu_n, swu_k, bu_ptr, idx_ptr, hl_ptr, ib_ptr, hs_ptr,
                       M, K, N, pid_r, rn, n_ok, rm, m_ok, valid, xbase, rk,
                       GATED, HAS_BG, HAS_BU, MB, BN, BK)


@triton.jit
def _gate_epilogue(acc, x_ptr, sx_k, bg_ptr, wu_ptr, swu_n, swu_k, bu_ptr, idx_ptr, hl_ptr, ib_ptr, hs_ptr,
                   M, K, N, pid_r, rn, n_ok, rm, m_ok, valid, xbase, rk,
                   GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr,
                   MB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """relu, the active set, u for active neurons, the list append and the statistics."""
    if HAS_BG:
        acc += tl.load(bg_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    v = tl.where(acc < 0.0, 0.0, acc)                      # relu, NaN kept
    nz = (v != 0.0) & valid                                # NaN != 0: counted, as eager's count
    act = (nz | ~(tl.abs(acc) < float("inf"))) & valid     # + non-finite g (x row with NaN/Inf)
    col = tl.max(act.to(tl.int32), axis=0) > 0             # [BN]: active in some row
    rowcnt = tl.sum(nz.to(tl.int32), axis=1)
    tl.atomic_add(ib_ptr + rm, rowcnt, mask=m_ok & (rowcnt > 0), sem="relaxed")
    total = tl.sum(rowcnt, axis=0)
    if total > 0:
        tl.atomic_add(ib_ptr + M, total, sem="relaxed")
    ncol = tl.sum(col.to(tl.int32), axis=0)
    if ncol > 0:
        if GATED:
            wu_base = wu_ptr + rn.to(tl.int64)[:, None] * swu_n
            u = tl.zeros((MB, BN), dtype=tl.float32)
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
        h = tl.where(valid & col[None, :], h, 0.0)
        hb = h.to(x_ptr.dtype.element_ty)
        tl.atomic_add(hs_ptr, tl.sum(tl.sum(tl.abs(hb.to(tl.float32)), axis=1), axis=0), sem="relaxed")
        base = tl.atomic_add(ib_ptr + M + 1 + pid_r, ncol, sem="relaxed")
        pos = pid_r * N + base + tl.cumsum(col.to(tl.int32), axis=0) - 1   # row block's list
        tl.store(idx_ptr + pos, rn, mask=col)
        tl.store(hl_ptr + pos.to(tl.int64)[None, :] * MB + tl.arange(0, MB)[:, None], hb, mask=col[None, :])


@triton.jit
def decode_down_kernel(
    idx_ptr, hl_ptr, ib_ptr, wdt_ptr, swd_n, swd_k, bd_ptr, y_ptr, sy_m, sy_k, part_ptr,
    M, N, KO,
    HAS_BD: tl.constexpr, MB: tl.constexpr, E: tl.constexpr, BKO: tl.constexpr, S: tl.constexpr,
):
    pid_o = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_r = tl.program_id(2)
    n_list = tl.load(ib_ptr + M + 1 + pid_r)
    ko = pid_o * BKO + tl.arange(0, BKO)
    o_ok = ko < KO
    re = tl.arange(0, E)
    rl = tl.arange(0, MB)
    lbase = pid_r * N
    acc = tl.zeros((MB, BKO), dtype=tl.float32)
    for e0 in range(pid_s * E, n_list, S * E):
        ee = e0 + re
        e_ok = ee < n_list
        n = tl.load(idx_ptr + lbase + ee, mask=e_ok, other=0)
        hv = tl.load(hl_ptr + (lbase + ee).to(tl.int64)[None, :] * MB + rl[:, None], mask=e_ok[None, :], other=0.0)
        w = tl.load(wdt_ptr + n.to(tl.int64)[:, None] * swd_n + ko[None, :] * swd_k,
                    mask=e_ok[:, None] & o_ok[None, :], other=0.0)
        acc = tl.dot(hv, w, acc)
    rm = pid_r * MB + rl
    m_ok = rm < M
    if S == 1:
        if HAS_BD:
            acc += tl.load(bd_ptr + ko, mask=o_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * sy_m + ko[None, :] * sy_k,
                 acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & o_ok[None, :])
    else:
        tl.store(part_ptr + (pid_s * M + rm.to(tl.int64))[:, None] * KO + ko[None, :], acc,
                 mask=m_ok[:, None] & o_ok[None, :])


@triton.jit
def decode_sum_kernel(part_ptr, bd_ptr, y_ptr, sy_m, sy_k, M, KO,
                      HAS_BD: tl.constexpr, S: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < M * KO
    acc = tl.load(part_ptr + idx, mask=ok, other=0.0)
    for s in tl.static_range(1, S):
        acc += tl.load(part_ptr + s * M * KO + idx, mask=ok, other=0.0)
    m = idx // KO
    ko = idx % KO
    if HAS_BD:
        acc += tl.load(bd_ptr + ko, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * sy_m + ko * sy_k, acc.to(y_ptr.dtype.element_ty), mask=ok)
