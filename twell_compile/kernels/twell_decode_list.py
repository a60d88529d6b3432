"""Triton device code: the decode path's pairs form (per active pair, atomics) and list form
(two launches, no atomics, deterministic).

For M above a few rows the one-launch kernel (twell_decode.py) spends its time in the down
projection: each block of neurons adds its [M, K_out] contribution with fp32 atomics, and its
tl.dot loops over K and K_out are latency-bound (H200, K=2048, N=5632, M=16, d=0.005: 32.1 us
vs dense 34.1). Here the work is per active (row, neuron) pair instead:

``decode_pairs_kernel`` (grid: N / BN neuron blocks x row blocks of MB rows), one program per
  block: the gate (``gate_block``: all of K, relu, the active set), then the active (row,
  neuron) pairs PB at a time: u = x[row] . W_up[neuron] with whole-row gathers (one memory
  round trip per PB pairs, K in chunks of KC), h = v * u rounded to x's dtype as eager rounds
  h for the down GEMM. Statistics: the pairs form adds them into counters as the fused kernel
  does (rc_ptr, hs_ptr: the counters); the list form writes them per block (rc_ptr: non-zeros
  per (row block, block, row), hs_ptr: sum |h| per block), summed in a fixed order by the
  gather launch (integer counts and one fp32 order: bitwise repeatable).
  ADOWN (the pairs form, ``form="pairs"``): the pair's W_d^T row (first KOC columns requested
  with the W_up row) times h goes into the fp32 accumulator [M, K_out] by relaxed atomics,
  M x K_out values per pair instead of the tiles form's whole [MB, K_out] tile per block;
  ``decode_finish_kernel`` (twell_decode.py) then writes y (H200, K=2048, M=16, d=0.005: 21.2
  us against the list form's 26.5; docs/design-notes/decode.md).
  Otherwise (the list form): the pairs of token m in block b go to slots [b * BN, b * BN +
  count) of token m's list (neuron index and h), in neuron order; count per (token, block) is
  written, not added, so nothing needs zeroing between calls.
  UDOT (Config.udot, off by default): u for all rows of the block's active neurons in one
  tl.dot over K instead (``_up_dot``; inactive W_up rows masked, never read).
``decode_gather_kernel`` (list form; grid: M x K_out / BO programs, + 1 for the statistics):
  program (m, o) prefix-sums token m's counts over the blocks, then takes LE list entries per
  step: their neuron indices and h, and W_d^T rows [LE, BO] gathered in one round trip, summed
  in fp32. At d=0.005 a token has ~28 entries: one step. y = that + b_d, written once.
Every (token, neuron) pair is listed (capacity N per token): exact at any density. The list
form sums in a fixed order: repeated calls give identical bits (the policy's choice under
torch.use_deterministic_algorithms).
"""

import triton
import triton.language as tl

from twell_compile.kernels.act import gate_part, up_part
from twell_compile.kernels.pdl import pdl_enter
from twell_compile.kernels.twell_decode import add_stats, finish_stats, gate_block, rows_dot


@triton.jit
def _up_dot(x_ptr, xbase, sx_k, wu_ptr, swu_n, swu_k, bu_ptr, v, act, rn, m_ok, K,
            GATED: tl.constexpr, HAS_BU: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr,
            BKU: tl.constexpr, ACT: tl.constexpr):
    """h [MB, BN] (fp32, rounded to x's dtype as eager rounds h; 0 off the active pairs) with u
    for every row of the block's active neurons from one tl.dot over K (inactive W_up rows are
    masked, so never read)."""
    if GATED:
        col = tl.max(act.to(tl.int32), axis=0) > 0
        h = v * up_part(rows_dot(xbase, sx_k, wu_ptr, swu_n, swu_k, bu_ptr, col, rn, m_ok, K, HAS_BU, MB, BN, BKU),
                        ACT)
    else:
        h = v
    return tl.where(act, h, 0.0).to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _down_pairs(acc_ptr, wdt_ptr, swd_n, swd_k, wd, mg, ng, h, p_ok, KO, KOC: tl.constexpr):
    """acc[mg] += h * W_d^T[ng] for PB pairs (fp32 relaxed atomics); wd: the rows' first KOC
    columns, loaded by the caller."""
    ko = tl.arange(0, KOC)
    base = acc_ptr + mg[:, None] * KO
    tl.atomic_add(base + ko[None, :], h[:, None] * wd.to(tl.float32),
                  mask=p_ok[:, None] & (ko < KO)[None, :], sem="relaxed")
    for o0 in range(KOC, KO, KOC):
        kk = o0 + ko
        ok = p_ok[:, None] & (kk < KO)[None, :]
        w = tl.load(wdt_ptr + ng[:, None] * swd_n + kk[None, :] * swd_k, mask=ok, other=0.0)
        tl.atomic_add(base + kk[None, :], h[:, None] * w.to(tl.float32), mask=ok, sem="relaxed")


@triton.jit
def decode_pairs_kernel(
    x_ptr, sx_m, sx_k, wg_ptr, swg_n, swg_k, bg_ptr, wu_ptr, swu_n, swu_k, bu_ptr,
    ln_ptr, lh_ptr, lc_ptr, rc_ptr, hs_ptr, wdt_ptr, swd_n, swd_k, acc_ptr,
    M, K, N, NB, KO,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr,
    MB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PB: tl.constexpr, KC: tl.constexpr,
    UDOT: tl.constexpr, BKU: tl.constexpr, ADOWN: tl.constexpr, KOC: tl.constexpr,
    PDL: tl.constexpr, ACT: tl.constexpr,
):
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_r = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    rm = pid_r * MB + tl.arange(0, MB)
    m_ok = rm < M
    xbase = x_ptr + rm.to(tl.int64)[:, None] * sx_m
    v, nz, act = gate_block(xbase, sx_k, wg_ptr, swg_n, swg_k, bg_ptr, rn, n_ok, m_ok, K,
                             HAS_BG, MB, BN, BK)
    v = gate_part(v, ACT)                                    # a(relu(g)); nz, act: relu(g)'s
    blk = pid_r * tl.num_programs(0) + pid_n
    ai = act.to(tl.int32)
    if not ADOWN:     # the list form: counts, and each pair's list slot (block's base + rank in its row)
        tl.store(rc_ptr + blk.to(tl.int64) * MB + tl.arange(0, MB), tl.sum(nz.to(tl.int32), axis=1))
        tl.store(lc_ptr + rm.to(tl.int64) * NB + pid_n, tl.sum(ai, axis=1), mask=m_ok)
        pos = rm.to(tl.int64)[:, None] * N + pid_n * BN + tl.cumsum(ai, axis=1) - 1
        tl.store(ln_ptr + pos, tl.zeros((MB, BN), dtype=tl.int32) + rn[None, :], mask=act)
    npair = tl.sum(tl.sum(ai, axis=1), axis=0)
    hsum = tl.sum(tl.zeros((PB,), dtype=tl.float32), axis=0)
    if UDOT and not ADOWN:
        if npair > 0:
            h = _up_dot(x_ptr, xbase, sx_k, wu_ptr, swu_n, swu_k, bu_ptr, v, act, rn, m_ok,
                        K, GATED, HAS_BU, MB, BN, BKU, ACT)
            tl.store(lh_ptr + pos, h, mask=act)
            hsum = tl.sum(tl.sum(tl.abs(h), axis=1), axis=0)
    elif npair > 0:
        fa = tl.reshape(ai, (MB * BN,))
        rank = tl.cumsum(fa, axis=0)                     # 1-based rank at the active pairs
        fi = tl.arange(0, MB * BN)
        if UDOT:      # h of every pair from one tl.dot; the loop below only adds them to acc
            fv = tl.reshape(_up_dot(x_ptr, xbase, sx_k, wu_ptr, swu_n, swu_k, bu_ptr, v, act, rn, m_ok,
                                    K, GATED, HAS_BU, MB, BN, BKU, ACT), (MB * BN,))
        else:
            fv = tl.reshape(v, (MB * BN,))
        if not ADOWN:
            fp = tl.reshape(pos, (MB * BN,))
        rp = tl.arange(0, PB)
        for p0 in range(0, npair, PB):
            want = p0 + 1 + rp
            p_ok = want <= npair
            sel = (rank[None, :] == want[:, None]) & (fa[None, :] > 0)          # [PB, MB * BN]
            f = tl.sum(tl.where(sel, fi[None, :], 0), axis=1)
            vp = tl.sum(tl.where(sel, fv[None, :], 0.0), axis=1)                # NaN/Inf kept
            mg = (pid_r * MB + f // BN).to(tl.int64)
            ng = (pid_n * BN + f % BN).to(tl.int64)
            if ADOWN:     # the first K_out chunk of the W_d^T rows, requested with W_up's
                ko = tl.arange(0, KOC)
                wd = tl.load(wdt_ptr + ng[:, None] * swd_n + ko[None, :] * swd_k,
                             mask=p_ok[:, None] & (ko < KO)[None, :], other=0.0)
            if GATED and not UDOT:
                u = tl.zeros((PB,), dtype=tl.float32)
                for k0 in range(0, K, KC):
                    kk = k0 + tl.arange(0, KC)
                    ld = p_ok[:, None] & (kk < K)[None, :]
                    xr = tl.load(x_ptr + mg[:, None] * sx_m + kk[None, :] * sx_k, mask=ld, other=0.0)
                    wr = tl.load(wu_ptr + ng[:, None] * swu_n + kk[None, :] * swu_k, mask=ld, other=0.0)
                    u += tl.sum(xr.to(tl.float32) * wr.to(tl.float32), axis=1)
                if HAS_BU:
                    u += tl.load(bu_ptr + ng, mask=p_ok, other=0.0).to(tl.float32)
                h = (vp * up_part(u, ACT)).to(x_ptr.dtype.element_ty).to(tl.float32)   # eager's rounding
            elif UDOT:
                h = vp                                                          # rounded already
            else:
                h = vp.to(x_ptr.dtype.element_ty).to(tl.float32)
            hsum += tl.sum(tl.where(p_ok, tl.abs(h), 0.0), axis=0)
            if ADOWN:
                _down_pairs(acc_ptr, wdt_ptr, swd_n, swd_k, wd, mg, ng, h, p_ok, KO, KOC)
            else:
                slot = tl.sum(tl.where(sel, fp[None, :], 0), axis=1)
                tl.store(lh_ptr + slot, h, mask=p_ok)
    if ADOWN:
        add_stats(rc_ptr, hs_ptr, nz, hsum, rm, m_ok)
    else:
        tl.store(hs_ptr + blk, hsum)


@triton.jit
def decode_gather_kernel(
    ln_ptr, lh_ptr, lc_ptr, wdt_ptr, swd_n, swd_k, bd_ptr, y_ptr, sy_m, sy_k,
    rc_ptr, hs_ptr, tok_ptr, hsum_ptr, st_ptr,
    M, N, KO, NB, NO, NRB,
    HAS_BD: tl.constexpr, HAS_ST: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr,
    NBP: tl.constexpr, LE: tl.constexpr, BO: tl.constexpr, RB: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    if pid == M * NO:
        finish_stats(rc_ptr, hs_ptr, tok_ptr, hsum_ptr, st_ptr, M, NB, NRB, HAS_ST, MB, RB)
    else:
        m = pid // NO
        ko = (pid % NO) * BO + tl.arange(0, BO)
        o_ok = ko < KO
        rb = tl.arange(0, NBP)
        cnt = tl.load(lc_ptr + m.to(tl.int64) * NB + rb, mask=rb < NB, other=0)
        incl = tl.cumsum(cnt, axis=0)
        excl = incl - cnt
        total = tl.sum(cnt, axis=0)
        re = tl.arange(0, LE)
        acc = tl.zeros((BO,), dtype=tl.float32)
        for e0 in range(0, total, LE):
            e = e0 + re
            e_ok = e < total
            b = tl.sum((incl[None, :] <= e[:, None]).to(tl.int32), axis=1)     # entry's block
            off = e - tl.sum(tl.where(rb[None, :] == b[:, None], excl[None, :], 0), axis=1)
            slot = m.to(tl.int64) * N + b * BN + off
            n = tl.load(ln_ptr + slot, mask=e_ok, other=0)
            hv = tl.load(lh_ptr + slot, mask=e_ok, other=0.0)
            w = tl.load(wdt_ptr + n.to(tl.int64)[:, None] * swd_n + ko[None, :] * swd_k,
                        mask=e_ok[:, None] & o_ok[None, :], other=0.0)
            acc += tl.sum(hv[:, None] * w.to(tl.float32), axis=0)
        if HAS_BD:
            acc += tl.load(bd_ptr + ko, mask=o_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + m.to(tl.int64) * sy_m + ko * sy_k, acc.to(y_ptr.dtype.element_ty), mask=o_ok)
