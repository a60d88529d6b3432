"""Triton device code: the decode path (few tokens, M <= 256; the policy uses it up to 64).

At decode sizes the FFN is memory-bound: dense reads W_gate, W_up and W_down in full. Here
W_gate is read in full, W_up rows and W_down^T rows ([N, K_out] layout, made once per weight by
``weight_cache``) only for neurons active in at least one row of the row block. Rows are
padded to MB >= 16 (tl.dot's minimum) and split in row blocks of MB <= 32.

``decode_fused_kernel`` (grid: N / BN neuron blocks x row blocks), one program per block:
  g = x W_g^T + b_g over all of K (fp32, tl.dot), v = relu(g) (NaN kept). A neuron is active
  when some row has v != 0 or a non-finite g: a row of x holding NaN/Inf makes every g of that
  row NaN/Inf (0 * Inf = NaN in the dot), so such rows activate every neuron and the result
  propagates as dense's 0 * Inf does, with no separate check of x. A block with an active
  neuron then computes u = x W_u[active]^T (+ b_u), h = v * u (ACT: kernels/act.py's a(v) *
  b(u), v squared right after the gate for squared ReLU) rounded to x's dtype (as eager
  rounds h for the down GEMM), and adds h W_d^T[active] into the fp32 accumulator with relaxed
  atomics (`red`), in one of two forms: ``_up_down_rows`` (M <= MS rows: one active neuron at
  a time, its whole W_u and W_d^T rows in one round trip of loads) or ``_up_down_tiles``
  (tl.dot over K and K_out with masked rows: inactive neurons' rows never leave memory).
  Statistics (non-zeros per row, sum |h|) are added into counters kept with the accumulator
  (``add_stats``). FINISH: every program then takes a ticket of its row block (acq_rel
  atomic after a CTA barrier); the last one writes y = acc + b_d in x's dtype, zeroes acc
  again and resets the ticket (CLEAN: the accumulator is a persistent one, kept zero between
  calls, so no launch zero-fills it), and reads and zeroes the counters. One launch.
  GEMV (the rows form at M=1, Config.gemv_bn): the gate as a plain GEMV of whole W_gate rows
  over fewer neurons per program (``_gate_rows``) instead of tl.dot over rows padded to 16.
``decode_finish_kernel``: the same finish as a separate launch over all rows, for sizes where
  one program would take too long (M x K_out elements) or for several row blocks.
The atomics sum in varying order: the last bits of y vary between runs; the error bound does not.
PDL (Hopper+, launch.pdl_ok): every decode kernel starts with griddepcontrol.wait (it then
sees all of the previous kernel's writes) and at once lets its dependent launch begin, so with
programmatic dependent launch the next kernel's launch overlaps this one instead of following it.
"""

import triton
import triton.language as tl

from twell_compile.kernels.act import gate_part, up_part
from twell_compile.kernels.pdl import pdl_enter


@triton.jit
def _finish_span(acc_ptr, bd_ptr, y_ptr, sy_m, sy_k, lo, hi, KO,
                 HAS_BD: tl.constexpr, CLEAN: tl.constexpr, FB: tl.constexpr):
    """y[e] = acc[e] + b_d for flat accumulator elements e in [lo, hi) (row-major [M, KO])."""
    for e0 in range(lo, hi, FB):
        idx = e0 + tl.arange(0, FB)
        ok = idx < hi
        if CLEAN:
            # read and zero in one atomic: a load then a store of zeros may get different
            # thread layouts from Triton, and then one thread zeroes what another has not read
            # yet (H200: rel. error 0.26-0.5 at M=1, K_out=2048; seen in the PTX)
            # (on the int32 bits: the interpreter has no fp32 xchg)
            a = tl.atomic_xchg(acc_ptr.to(tl.pointer_type(tl.int32)) + idx, tl.zeros((FB,), dtype=tl.int32),
                               mask=ok, sem="relaxed").to(tl.float32, bitcast=True)
            a = tl.where(ok, a, 0.0)
        else:
            a = tl.load(acc_ptr + idx, mask=ok, other=0.0, cache_modifier=".cg")
        m = idx // KO
        ko = idx % KO
        if HAS_BD:
            a += tl.load(bd_ptr + ko, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + m.to(tl.int64) * sy_m + ko * sy_k, a.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def finish_stats(rc_ptr, hs_ptr, tok_ptr, hsum_ptr, st_ptr, M, NB, NRB,
                  HAS_ST: tl.constexpr, MB: tl.constexpr, RB: tl.constexpr):
    """Statistics [NRB, NB, MB] -> non-zeros per token, their total (tok[M]), sum |h|, and the
    layer's stats buffer [sum, max non-zeros per token, sum |h|, overflows = 0] (float64)."""
    rl = tl.arange(0, MB)
    total = tl.sum(tl.zeros((MB,), dtype=tl.int32), axis=0)
    most = total
    hsv = tl.zeros((RB,), dtype=tl.float32)
    for r in range(NRB):
        cnt = tl.zeros((MB,), dtype=tl.int32)
        for b0 in range(0, NB, RB):
            bb = b0 + tl.arange(0, RB)
            b_ok = bb < NB
            cnt += tl.sum(tl.load(rc_ptr + ((r * NB + bb) * MB)[:, None] + rl[None, :],
                                  mask=b_ok[:, None], other=0, cache_modifier=".cg"), axis=0)
            hsv += tl.load(hs_ptr + r * NB + bb, mask=b_ok, other=0.0, cache_modifier=".cg")
        rows = r * MB + rl
        tl.store(tok_ptr + rows, cnt, mask=rows < M)
        total += tl.sum(cnt, axis=0)
        most = tl.maximum(most, tl.max(cnt, axis=0))
    tl.store(tok_ptr + M, total)
    hsum = tl.sum(hsv, axis=0)
    tl.store(hsum_ptr, hsum)
    if HAS_ST:
        tl.store(st_ptr, total.to(tl.float64))
        tl.store(st_ptr + 1, most.to(tl.float64))
        tl.store(st_ptr + 2, hsum.to(tl.float64))
        tl.store(st_ptr + 3, 0.0)


@triton.jit
def add_stats(cnt_ptr, hsa_ptr, nz, hsum, rm, m_ok):
    """Adds a block's non-zeros per row (nz [MB, BN]) and its sum |h| into the call's counters
    (relaxed atomics; skipped where zero: at d=0.005 most blocks add nothing). Added, not
    written per block: the finisher then reads M counts whatever the number of blocks (a sum
    over per-block counts grows with them: ~6.5 us at 1408 blocks, docs/design-notes/decode.md)."""
    c = tl.sum(nz.to(tl.int32), axis=1)
    tl.atomic_add(cnt_ptr + rm, c, mask=m_ok & (c != 0), sem="relaxed")
    if hsum != 0.0:       # NaN too
        tl.atomic_add(hsa_ptr, hsum, sem="relaxed")


@triton.jit
def finish_counts(cnt_ptr, hsa_ptr, tok_ptr, hsum_ptr, st_ptr, M, HAS_ST: tl.constexpr, CB: tl.constexpr):
    """Counters (``add_stats``) -> non-zeros per token and their total (tok[M + 1]), sum |h|,
    and the layer's stats buffer [sum, max non-zeros per token, sum |h|, overflows = 0]
    (float64); the counters are read and zeroed in one atomic each (as the accumulator)."""
    r = tl.arange(0, CB)
    ok = r < M
    c = tl.atomic_xchg(cnt_ptr + r, tl.zeros((CB,), dtype=tl.int32), mask=ok, sem="relaxed")
    c = tl.where(ok, c, 0)
    tl.store(tok_ptr + r, c, mask=ok)
    total = tl.sum(c, axis=0)
    tl.store(tok_ptr + M, total)
    # (on the int32 bits: the interpreter has no fp32 xchg)
    hs = tl.atomic_xchg(hsa_ptr.to(tl.pointer_type(tl.int32)), 0, sem="relaxed").to(tl.float32, bitcast=True)
    tl.store(hsum_ptr, hs)
    if HAS_ST:
        tl.store(st_ptr, total.to(tl.float64))
        tl.store(st_ptr + 1, tl.max(c, axis=0).to(tl.float64))
        tl.store(st_ptr + 2, hs.to(tl.float64))
        tl.store(st_ptr + 3, 0.0)


@triton.jit
def rows_dot(xbase, sx_k, w_ptr, sw_n, sw_k, b_ptr, sel, rn, m_ok, K,
              HAS_B: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """x W[rn]^T (+ b[rn]) [MB, BN] in fp32 by tl.dot over K in steps of BK; rows of W (and
    bias entries) outside ``sel`` are masked, so never read. The gate (sel: neurons in range)
    and the up projection (sel: active neurons) both use it."""
    rk = tl.arange(0, BK)
    w_base = w_ptr + rn.to(tl.int64)[:, None] * sw_n
    acc = tl.zeros((MB, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        k_ok = kk < K
        xk = tl.load(xbase + kk[None, :] * sx_k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + kk[None, :] * sw_k, mask=sel[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(xk, tl.trans(w), acc)
    if HAS_B:
        acc += tl.load(b_ptr + rn, mask=sel, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def gate_block(xbase, sx_k, wg_ptr, swg_n, swg_k, bg_ptr, rn, n_ok, m_ok, K,
                HAS_BG: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Returns (v, nz, act) for MB rows x BN neurons: g = x W_g^T + b_g over all of K (fp32,
    tl.dot); v = relu(g) (NaN kept); nz: v != 0 (NaN counted, as eager's count); act: nz or g non-finite (a row of
    x holding NaN/Inf: the pair must reach the down projection so the result propagates)."""
    g = rows_dot(xbase, sx_k, wg_ptr, swg_n, swg_k, bg_ptr, n_ok, rn, m_ok, K, HAS_BG, MB, BN, BK)
    valid = m_ok[:, None] & n_ok[None, :]
    v = tl.where(g < 0.0, 0.0, g)
    nz = (v != 0.0) & valid
    act = (nz | ~(tl.abs(g) < float("inf"))) & valid
    return v, nz, act


@triton.jit
def _gate_rows(x_ptr, sx_m, sx_k, wg_ptr, swg_n, swg_k, bg_ptr, rn, n_ok, rm, m_ok, M, K,
               HAS_BG: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr, MS: tl.constexpr, KP: tl.constexpr):
    """``gate_block`` for M <= MS rows as a plain GEMV: the block's BN whole W_gate rows in
    one request ([BN, KP]: one memory round trip), g by FMA in fp32, no rows padded to 16.
    Small BN then gives many programs (H200, M=1, K=2048, N=5632: 12.5 us at BN=4 against 14.9
    for the tl.dot gate at BN=32; benchmarks/results/h200/ffn_decode.json). W_gate is read once
    per call, so its lines are marked first to leave L2 (evict_first)."""
    rk = tl.arange(0, KP)
    k_ok = rk < K
    w = tl.load(wg_ptr + rn.to(tl.int64)[:, None] * swg_n + rk[None, :] * swg_k,
                mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first").to(tl.float32)
    g = tl.zeros((MB, BN), dtype=tl.float32)
    for m in tl.static_range(MS):
        x_ok = k_ok & (tl.full((KP,), m, tl.int32) < M)
        xm = tl.load(x_ptr + m * sx_m + rk * sx_k, mask=x_ok, other=0.0).to(tl.float32)
        g = tl.where((rm == m)[:, None], tl.sum(w * xm[None, :], axis=1)[None, :], g)
    if HAS_BG:
        g += tl.load(bg_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    valid = m_ok[:, None] & n_ok[None, :]
    v = tl.where(g < 0.0, 0.0, g)
    nz = (v != 0.0) & valid
    act = (nz | ~(tl.abs(g) < float("inf"))) & valid
    return v, nz, act


@triton.jit
def _up_down_tiles(x_ptr, sx_k, xbase, wu_ptr, swu_n, swu_k, bu_ptr, wdt_ptr, swd_n, swd_k, acc_ptr,
                   v, col, valid, rn, rm, m_ok, K, KO,
                   GATED: tl.constexpr, HAS_BU: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr,
                   BKU: tl.constexpr, BKO: tl.constexpr, ACT: tl.constexpr):
    """Up and down for the block's active neurons as tl.dot tiles over K and K_out (masked
    rows: inactive neurons' weights are not read). Returns sum |h|."""
    if GATED:
        h = v * up_part(rows_dot(xbase, sx_k, wu_ptr, swu_n, swu_k, bu_ptr, col, rn, m_ok, K, HAS_BU, MB, BN, BKU),
                        ACT)
    else:
        h = v
    hb = tl.where(valid & col[None, :], h, 0.0).to(x_ptr.dtype.element_ty)
    wd_base = wdt_ptr + rn.to(tl.int64)[:, None] * swd_n
    ybase = acc_ptr + rm.to(tl.int64)[:, None] * KO
    for o0 in range(0, KO, BKO):
        ko = o0 + tl.arange(0, BKO)
        o_ok = ko < KO
        w = tl.load(wd_base + ko[None, :] * swd_k, mask=col[:, None] & o_ok[None, :], other=0.0)
        tl.atomic_add(ybase + ko[None, :], tl.dot(hb, w), mask=m_ok[:, None] & o_ok[None, :], sem="relaxed")
    return tl.sum(tl.sum(tl.abs(hb.to(tl.float32)), axis=1), axis=0)


@triton.jit
def _up_down_rows(x_ptr, sx_m, sx_k, wu_ptr, swu_n, swu_k, bu_ptr, wdt_ptr, swd_n, swd_k, acc_ptr,
                  v, col, ncol, rn, rm, M, K, KO,
                  GATED: tl.constexpr, HAS_BU: tl.constexpr, MB: tl.constexpr, MS: tl.constexpr,
                  KP: tl.constexpr, KOP: tl.constexpr, ACT: tl.constexpr):
    """Up and down for M <= MS rows, one active neuron at a time with whole-row loads (its W_up
    row, W_d^T row and the x rows at once: one memory round trip per neuron instead of a loop
    over K and K_out). Returns sum |h|."""
    rs = tl.arange(0, MS)
    s_ok = rs < M
    rk = tl.arange(0, KP)
    ro = tl.arange(0, KOP)
    o_ok = ro < KO
    pick = rm[:, None] == rs[None, :]                              # [MB, MS]: gate rows -> rows
    csum = tl.cumsum(col.to(tl.int32), axis=0)
    hsum = tl.sum(tl.zeros((MS,), dtype=tl.float32), axis=0)
    if GATED:
        xs = tl.load(x_ptr + rs.to(tl.int64)[:, None] * sx_m + rk[None, :] * sx_k,
                     mask=s_ok[:, None] & (rk < K)[None, :], other=0.0)    # kept in x's dtype
    for j in range(ncol):
        sel = col & (csum == j + 1)                                # the j-th active neuron
        nj = tl.sum(tl.where(sel, rn, 0), axis=0).to(tl.int64)
        vj = tl.sum(tl.where(pick, tl.sum(tl.where(sel[None, :], v, 0.0), axis=1)[:, None], 0.0), axis=0)
        wd = tl.load(wdt_ptr + nj * swd_n + ro * swd_k, mask=o_ok, other=0.0)
        if GATED:
            wu = tl.load(wu_ptr + nj * swu_n + rk * swu_k, mask=rk < K, other=0.0)
            u = tl.sum(xs.to(tl.float32) * wu.to(tl.float32)[None, :], axis=1)
            if HAS_BU:
                u += tl.load(bu_ptr + nj).to(tl.float32)
            h = vj * up_part(u, ACT)
        else:
            h = vj
        h = tl.where(s_ok, h, 0.0).to(x_ptr.dtype.element_ty).to(tl.float32)   # eager's rounding
        hsum += tl.sum(tl.abs(h), axis=0)
        tl.atomic_add(acc_ptr + rs.to(tl.int64)[:, None] * KO + ro[None, :], h[:, None] * wd.to(tl.float32)[None, :],
                      mask=s_ok[:, None] & o_ok[None, :], sem="relaxed")
    return hsum


@triton.jit
def decode_fused_kernel(
    x_ptr, sx_m, sx_k, wg_ptr, swg_n, swg_k, bg_ptr, wu_ptr, swu_n, swu_k, bu_ptr,
    wdt_ptr, swd_n, swd_k, bd_ptr, acc_ptr, tk_ptr, cnt_ptr, hsa_ptr,
    y_ptr, sy_m, sy_k, tok_ptr, hsum_ptr, st_ptr,
    M, K, N, KO,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, HAS_BD: tl.constexpr,
    FINISH: tl.constexpr, CLEAN: tl.constexpr, HAS_ST: tl.constexpr,
    MB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BKU: tl.constexpr, BKO: tl.constexpr,
    MS: tl.constexpr, KP: tl.constexpr, KOP: tl.constexpr, FB: tl.constexpr, CB: tl.constexpr,
    GEMV: tl.constexpr, PDL: tl.constexpr, ACT: tl.constexpr,
):
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_r = tl.program_id(1)
    nb = tl.num_programs(0)
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    rm = pid_r * MB + tl.arange(0, MB)
    m_ok = rm < M
    valid = m_ok[:, None] & n_ok[None, :]
    xbase = x_ptr + rm.to(tl.int64)[:, None] * sx_m
    if GEMV:
        v, nz, act = _gate_rows(x_ptr, sx_m, sx_k, wg_ptr, swg_n, swg_k, bg_ptr, rn, n_ok, rm, m_ok, M, K,
                                HAS_BG, MB, BN, MS, KP)
    else:
        v, nz, act = gate_block(xbase, sx_k, wg_ptr, swg_n, swg_k, bg_ptr, rn, n_ok, m_ok, K,
                                 HAS_BG, MB, BN, BK)
    v = gate_part(v, ACT)                                    # a(relu(g)); nz, act: relu(g)'s
    col = tl.max(act.to(tl.int32), axis=0) > 0             # [BN]: active in some row
    hsum = tl.sum(tl.zeros((BN,), dtype=tl.float32), axis=0)
    ncol = tl.sum(col.to(tl.int32), axis=0)
    if ncol > 0:
        if MS > 0:
            hsum = _up_down_rows(x_ptr, sx_m, sx_k, wu_ptr, swu_n, swu_k, bu_ptr, wdt_ptr, swd_n, swd_k,
                                 acc_ptr, v, col, ncol, rn, rm, M, K, KO, GATED, HAS_BU, MB, MS, KP, KOP, ACT)
        else:
            hsum = _up_down_tiles(x_ptr, sx_k, xbase, wu_ptr, swu_n, swu_k, bu_ptr, wdt_ptr, swd_n, swd_k,
                                  acc_ptr, v, col, valid, rn, rm, m_ok, K, KO, GATED, HAS_BU, MB, BN, BKU, BKO, ACT)
    add_stats(cnt_ptr, hsa_ptr, nz, hsum, rm, m_ok)
    if FINISH:
        # the row block's last program finishes it (split-K "serial fixup" pattern): the CTA
        # barrier orders every thread's adds before the release; the acquire makes everyone
        # else's visible to this program
        tl.debug_barrier()
        ticket = tl.atomic_add(tk_ptr + pid_r, 1, sem="acq_rel")
        if ticket == nb - 1:
            lo = pid_r * MB * KO
            _finish_span(acc_ptr, bd_ptr, y_ptr, sy_m, sy_k, lo, tl.minimum(M * KO, lo + MB * KO), KO,
                         HAS_BD, CLEAN, FB)
            finish_counts(cnt_ptr, hsa_ptr, tok_ptr, hsum_ptr, st_ptr, M, HAS_ST, CB)
            tl.store(tk_ptr + pid_r, 0)


@triton.jit
def decode_finish_kernel(acc_ptr, bd_ptr, y_ptr, sy_m, sy_k, cnt_ptr, hsa_ptr, tok_ptr, hsum_ptr, st_ptr,
                         M, KO,
                         HAS_BD: tl.constexpr, CLEAN: tl.constexpr, HAS_ST: tl.constexpr,
                         BLOCK: tl.constexpr, CB: tl.constexpr, PDL: tl.constexpr):
    """The finish as its own launch: BLOCK accumulator elements per program, the last program
    reads the statistics counters."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    if pid < tl.num_programs(0) - 1:
        lo = pid * BLOCK
        _finish_span(acc_ptr, bd_ptr, y_ptr, sy_m, sy_k, lo, tl.minimum(M * KO, lo + BLOCK), KO,
                     HAS_BD, CLEAN, BLOCK)
    else:
        finish_counts(cnt_ptr, hsa_ptr, tok_ptr, hsum_ptr, st_ptr, M, HAS_ST, CB)
