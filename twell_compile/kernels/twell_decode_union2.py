"""Triton device code: the decode path's union2 form (the gate as one GEMM, then three small
launches over the batch's union of active neurons, plus the finish).

Built around bytes. For M >= 16 rows the union of neurons active in some row is a large part of
N (i.i.d. d=0.005: 7.4% / 27% / 47% / 72% at M = 16 / 64 / 128 / 256), so W_gate is read in full
once, W_up and W_d^T only on the union's rows, each row once for all M tokens, and everything
else stays small: a tile of C weight rows and R token rows moves (C + R) x BK x 2 bytes per K
step, so x (or h) read again per program costs M / C times the weight bytes; programs run over
chunks of the COMPACTED union (their count follows the union, each gathered row is live) and
keep all M rows inside the program as row tiles of MT <= 32 (tl.dot's M side; 64 selects
Hopper's wgmma, see arch.MAX_MB) sharing each weight tile.

The gate, g = x W_g^T + b_g [M, N] in x's dtype, is the host's cuBLAS call (cuda_decode; eager's
own call, so g and the active set are eager's bits). Then:

``decode_union2_list_kernel`` (grid: N / BL neuron blocks): zeroes the up launch's tickets
  (TK), reads the block's g for all rows in row tiles, a neuron is in the union when some row
  has relu(g) != 0 or a non-finite g (a row of x holding NaN/Inf makes its g non-finite, so the
  result propagates as dense's 0 * Inf does); writes the block's count (lc, written, not added: nothing to zero) and its union
  neurons in neuron order to the block's fixed slots [b BL, b BL + count) (ln). Adds the
  non-zeros of relu(g) per row into the call's counters.
``decode_union2_up_kernel`` (grid: row groups of MR rows x N / C chunks; programs past the
  union's size exit): program (r, j) prefix-sums the NB block counts (the union's size U and
  each slot's place), maps union entries [j C, j C + C) to neurons, and computes u^T for its C
  gathered W_up rows and its MR rows: per K step one [C, BK] W_up tile, NT = MR / MT x tiles
  [MT, BK], NT dots into NT accumulators [MT, C] (W_up read once for all rows when MR is all
  of M). h = a(relu(g)) b(u + b_u) (kernels/act.py; 0 off the active pairs) rounded to x's
  dtype as eager rounds h; written compactly h[m, e] ([M, N] scratch, row-major: entry e of
  the union in column e) with the compact neuron list ci[e]. DENSE_UP: u is read from a dense
  cuBLAS up projection [M, N] instead of the dot (the whole W_up read; for large unions).
  Adds sum |h| into the call's counter. SK > 1 (a third grid axis): program (r, j, s) takes the
  s-th of SK shares of K (KS each, a multiple of BK) and stores its fp32 partials; the chunk's
  last program to take its ticket (tk, zeroed by the list launch) sums the SK partials in
  split order (deterministic) and forms h. More programs, each with a shorter K loop: the
  chunks alone are 26-48 programs at 16-64 rows (d=0.005, N=5632). H200, graphed, 4 splits:
  27.4 / 45.0 / 69.8 us at 16 / 64 / 128 rows against 29.4 / 52.6 / 76.4 unsplit
  (results/h200/ffn_decode_union2_fields.json).
``decode_union2_down_kernel`` (grid: K_out / BO tiles x S splits of the union): program (o, s)
  takes the s-th of S equal shares of the union, CD entries at a time: W_d^T rows [CD, BO]
  gathered by ci (contiguous rows when W_down is stored transposed) once, h tiles [MT, CD] per
  row tile, NT dots; h is read K_out / BO times in all. DIRECT (S == 1): y = acc + b_d in x's
  dtype, program (0, 0) reads the statistics counters (``finish_counts``), no finish launch.
  Otherwise relaxed fp32 atomics into the accumulator (S x M x K_out) and
  ``decode_finish_kernel`` (twell_decode.py) writes y, the statistics and zeroes it again.
Every neuron of the union is listed (capacity N): exact at any density.
"""

import triton
import triton.language as tl

from twell_compile.kernels.act import gate_part, up_part
from twell_compile.kernels.pdl import pdl_enter
from twell_compile.kernels.twell_decode import finish_counts


@triton.jit
def decode_union2_list_kernel(g_ptr, ln_ptr, lc_ptr, cnt_ptr, tk_ptr, M, N,
                              BL: tl.constexpr, RT: tl.constexpr, TK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    rn = pid * BL + tl.arange(0, BL)
    n_ok = rn < N
    if TK:                                                    # the up launch's tickets, zeroed per call
        tl.store(tk_ptr + rn, tl.zeros((BL,), dtype=tl.int32))
    ci = tl.zeros((BL,), dtype=tl.int32)
    for r0 in range(0, M, RT):
        rm = r0 + tl.arange(0, RT)
        m_ok = rm < M
        valid = m_ok[:, None] & n_ok[None, :]
        g = tl.load(g_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], mask=valid, other=0.0).to(tl.float32)
        v = tl.where(g < 0.0, 0.0, g)
        nz = (v != 0.0) & valid                                  # NaN counted, as eager's count
        act = (nz | ~(tl.abs(g) < float("inf"))) & valid
        ci = tl.maximum(ci, tl.max(act.to(tl.int32), axis=0))
        c = tl.sum(nz.to(tl.int32), axis=1)
        tl.atomic_add(cnt_ptr + rm, c, mask=m_ok & (c != 0), sem="relaxed")
    tl.store(lc_ptr + pid, tl.sum(ci, axis=0))
    slot = pid * BL + tl.cumsum(ci, axis=0) - 1
    tl.store(ln_ptr + slot, rn, mask=ci > 0)


@triton.jit
def _xdot(x_ptr, sx_m, sx_k, r0, kk, k_ok, wt, acc, M, MT: tl.constexpr):
    """acc + x[r0:r0+MT, kk] @ wt (one row tile of the up projection)."""
    rm = r0 + tl.arange(0, MT)
    xk = tl.load(x_ptr + rm.to(tl.int64)[:, None] * sx_m + kk[None, :] * sx_k,
                 mask=(rm < M)[:, None] & k_ok[None, :], other=0.0)
    return tl.dot(xk, wt, acc)


@triton.jit
def _h_tile(acc, r0, n, e, e_ok, g_ptr, u_ptr, bu_ptr, h_ptr, M, N,
            GATED: tl.constexpr, HAS_BU: tl.constexpr, DENSE_UP: tl.constexpr, ACT: tl.constexpr,
            MT: tl.constexpr):
    """h for rows [r0, r0 + MT) of the chunk's union entries (acc: their u, fp32), written
    compactly at h[m, e] in h's dtype; returns its sum |h|."""
    rm = r0 + tl.arange(0, MT)
    ok = (rm < M)[:, None] & e_ok[None, :]
    rows = rm.to(tl.int64)[:, None] * N
    g = tl.load(g_ptr + rows + n[None, :], mask=ok, other=0.0).to(tl.float32)
    v = tl.where(g < 0.0, 0.0, g)
    act = ((v != 0.0) | ~(tl.abs(g) < float("inf"))) & ok
    v = gate_part(v, ACT)
    if GATED:
        if DENSE_UP:                                          # eager's u (bias included), x's dtype
            u = tl.load(u_ptr + rows + n[None, :], mask=ok, other=0.0).to(tl.float32)
        else:
            u = acc
            if HAS_BU:
                u += tl.load(bu_ptr + n, mask=e_ok, other=0.0).to(tl.float32)[None, :]
        h = v * up_part(u, ACT)
    else:
        h = v
    h = tl.where(act, h, 0.0).to(h_ptr.dtype.element_ty)      # eager's rounding
    tl.store(h_ptr + rows + e[None, :], h, mask=ok)
    return tl.sum(tl.sum(tl.abs(h.to(tl.float32)), axis=1), axis=0)


@triton.jit
def decode_union2_up_kernel(
    x_ptr, sx_m, sx_k, wu_ptr, swu_n, swu_k, bu_ptr, g_ptr, u_ptr,
    ln_ptr, lc_ptr, ci_ptr, h_ptr, hsa_ptr, part_ptr, tk_ptr,
    M, K, N, NB, KS,
    GATED: tl.constexpr, HAS_BU: tl.constexpr, DENSE_UP: tl.constexpr, UP_DOT: tl.constexpr,
    BL: tl.constexpr, NBP: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, MT: tl.constexpr, NT: tl.constexpr, SK: tl.constexpr, PDL: tl.constexpr,
    ACT: tl.constexpr,
):
    pdl_enter(PDL)
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_s = tl.program_id(2)
    rb = tl.arange(0, NBP)
    cnt = tl.load(lc_ptr + rb, mask=rb < NB, other=0)
    incl = tl.cumsum(cnt, axis=0)
    total = tl.sum(cnt, axis=0)                               # the union's size
    if pid_c * C < total:
        e = pid_c * C + tl.arange(0, C)                       # entries of the union
        e_ok = e < total
        b = tl.sum((incl[None, :] <= e[:, None]).to(tl.int32), axis=1)              # entry's block
        off = e - tl.sum(tl.where(rb[None, :] == b[:, None], (incl - cnt)[None, :], 0), axis=1)
        n = tl.load(ln_ptr + b * BL + off, mask=e_ok, other=0)
        if (pid_r == 0) & (pid_s == 0):
            tl.store(ci_ptr + e, n, mask=e_ok)                # the compact list for the down launch
        r0 = pid_r * (NT * MT)
        a0 = tl.zeros((MT, C), dtype=tl.float32)
        a1 = tl.zeros((MT, C), dtype=tl.float32)
        a2 = tl.zeros((MT, C), dtype=tl.float32)
        a3 = tl.zeros((MT, C), dtype=tl.float32)
        a4 = tl.zeros((MT, C), dtype=tl.float32)
        a5 = tl.zeros((MT, C), dtype=tl.float32)
        a6 = tl.zeros((MT, C), dtype=tl.float32)
        a7 = tl.zeros((MT, C), dtype=tl.float32)
        if UP_DOT:
            rk = tl.arange(0, BK)
            w_base = wu_ptr + n.to(tl.int64)[:, None] * swu_n
            k_lo = pid_s * KS                                 # this program's share of K (KS: BK multiple)
            for k0 in range(k_lo, tl.minimum(K, k_lo + KS), BK):
                kk = k0 + rk
                k_ok = kk < K
                # one W_up tile for every row tile of the program
                wt = tl.trans(tl.load(w_base + kk[None, :] * swu_k, mask=e_ok[:, None] & k_ok[None, :], other=0.0))
                a0 = _xdot(x_ptr, sx_m, sx_k, r0, kk, k_ok, wt, a0, M, MT)
                if NT > 1:
                    a1 = _xdot(x_ptr, sx_m, sx_k, r0 + MT, kk, k_ok, wt, a1, M, MT)
                if NT > 2:
                    a2 = _xdot(x_ptr, sx_m, sx_k, r0 + 2 * MT, kk, k_ok, wt, a2, M, MT)
                    a3 = _xdot(x_ptr, sx_m, sx_k, r0 + 3 * MT, kk, k_ok, wt, a3, M, MT)
                if NT > 4:
                    a4 = _xdot(x_ptr, sx_m, sx_k, r0 + 4 * MT, kk, k_ok, wt, a4, M, MT)
                    a5 = _xdot(x_ptr, sx_m, sx_k, r0 + 5 * MT, kk, k_ok, wt, a5, M, MT)
                    a6 = _xdot(x_ptr, sx_m, sx_k, r0 + 6 * MT, kk, k_ok, wt, a6, M, MT)
                    a7 = _xdot(x_ptr, sx_m, sx_k, r0 + 7 * MT, kk, k_ok, wt, a7, M, MT)
        if SK > 1:
            # split K: the chunk's last program (ticket) sums the SK partials in split order (the
            # same bits whatever order the programs ran in), then forms h; the CTA barrier orders
            # every thread's partial stores before the release, the acquire makes the others' visible
            pbase = part_ptr + ((pid_r * tl.num_programs(1) + pid_c) * SK).to(tl.int64) * (NT * MT * C)
            _part_put(pbase + pid_s * (NT * MT * C), a0, a1, a2, a3, a4, a5, a6, a7, MT, C, NT)
            tl.debug_barrier()
            ticket = tl.atomic_add(tk_ptr + pid_r * tl.num_programs(1) + pid_c, 1, sem="acq_rel")
            if ticket == SK - 1:
                a0 = _part_sum(pbase, 0, MT, C, NT, SK)
                if NT > 1:
                    a1 = _part_sum(pbase, 1, MT, C, NT, SK)
                if NT > 2:
                    a2 = _part_sum(pbase, 2, MT, C, NT, SK)
                    a3 = _part_sum(pbase, 3, MT, C, NT, SK)
                if NT > 4:
                    a4 = _part_sum(pbase, 4, MT, C, NT, SK)
                    a5 = _part_sum(pbase, 5, MT, C, NT, SK)
                    a6 = _part_sum(pbase, 6, MT, C, NT, SK)
                    a7 = _part_sum(pbase, 7, MT, C, NT, SK)
                _h_tiles(a0, a1, a2, a3, a4, a5, a6, a7, r0, n, e, e_ok, g_ptr, u_ptr, bu_ptr, h_ptr, hsa_ptr, M, N,
                         GATED, HAS_BU, DENSE_UP, ACT, MT, NT)
        else:
            _h_tiles(a0, a1, a2, a3, a4, a5, a6, a7, r0, n, e, e_ok, g_ptr, u_ptr, bu_ptr, h_ptr, hsa_ptr, M, N,
                     GATED, HAS_BU, DENSE_UP, ACT, MT, NT)


@triton.jit
def _part_put(base, a0, a1, a2, a3, a4, a5, a6, a7, MT: tl.constexpr, C: tl.constexpr, NT: tl.constexpr):
    """Store a split's NT accumulators [MT, C] (fp32) at base, row tile after row tile."""
    off = tl.arange(0, MT)[:, None] * C + tl.arange(0, C)[None, :]
    tl.store(base + off, a0)
    if NT > 1:
        tl.store(base + MT * C + off, a1)
    if NT > 2:
        tl.store(base + 2 * MT * C + off, a2)
        tl.store(base + 3 * MT * C + off, a3)
    if NT > 4:
        tl.store(base + 4 * MT * C + off, a4)
        tl.store(base + 5 * MT * C + off, a5)
        tl.store(base + 6 * MT * C + off, a6)
        tl.store(base + 7 * MT * C + off, a7)


@triton.jit
def _part_sum(pbase, t, MT: tl.constexpr, C: tl.constexpr, NT: tl.constexpr, SK: tl.constexpr):
    """Row tile t's accumulator: the SK splits' partials summed in split order (L2 reads)."""
    off = t * MT * C + tl.arange(0, MT)[:, None] * C + tl.arange(0, C)[None, :]
    acc = tl.load(pbase + off, cache_modifier=".cg")
    for s in tl.static_range(1, SK):
        acc += tl.load(pbase + s * (NT * MT * C) + off, cache_modifier=".cg")
    return acc


@triton.jit
def _h_tiles(a0, a1, a2, a3, a4, a5, a6, a7, r0, n, e, e_ok, g_ptr, u_ptr, bu_ptr, h_ptr, hsa_ptr, M, N,
             GATED: tl.constexpr, HAS_BU: tl.constexpr, DENSE_UP: tl.constexpr, ACT: tl.constexpr,
             MT: tl.constexpr, NT: tl.constexpr):
    """h for the program's NT row tiles (``_h_tile`` each), their sum |h| into the counter."""
    hsum = _h_tile(a0, r0, n, e, e_ok, g_ptr, u_ptr, bu_ptr, h_ptr, M, N, GATED, HAS_BU, DENSE_UP, ACT, MT)
    if NT > 1:
        hsum += _h_tile(a1, r0 + MT, n, e, e_ok, g_ptr, u_ptr, bu_ptr, h_ptr, M, N, GATED, HAS_BU, DENSE_UP,
                        ACT, MT)
    if NT > 2:
        hsum += _h_tile(a2, r0 + 2 * MT, n, e, e_ok, g_ptr, u_ptr, bu_ptr, h_ptr, M, N, GATED, HAS_BU,
                        DENSE_UP, ACT, MT)
        hsum += _h_tile(a3, r0 + 3 * MT, n, e, e_ok, g_ptr, u_ptr, bu_ptr, h_ptr, M, N, GATED, HAS_BU,
                        DENSE_UP, ACT, MT)
    if NT > 4:
        hsum += _h_tile(a4, r0 + 4 * MT, n, e, e_ok, g_ptr, u_ptr, bu_ptr, h_ptr, M, N, GATED, HAS_BU,
                        DENSE_UP, ACT, MT)
        hsum += _h_tile(a5, r0 + 5 * MT, n, e, e_ok, g_ptr, u_ptr, bu_ptr, h_ptr, M, N, GATED, HAS_BU,
                        DENSE_UP, ACT, MT)
        hsum += _h_tile(a6, r0 + 6 * MT, n, e, e_ok, g_ptr, u_ptr, bu_ptr, h_ptr, M, N, GATED, HAS_BU,
                        DENSE_UP, ACT, MT)
        hsum += _h_tile(a7, r0 + 7 * MT, n, e, e_ok, g_ptr, u_ptr, bu_ptr, h_ptr, M, N, GATED, HAS_BU,
                        DENSE_UP, ACT, MT)
    if hsum != 0.0:       # NaN too
        tl.atomic_add(hsa_ptr, hsum, sem="relaxed")


@triton.jit
def _hdot(h_ptr, N, r0, e, e_ok, w, acc, M, MT: tl.constexpr):
    """acc + h[r0:r0+MT, e] @ w (one row tile of the down projection)."""
    rm = r0 + tl.arange(0, MT)
    h = tl.load(h_ptr + rm.to(tl.int64)[:, None] * N + e[None, :], mask=(rm < M)[:, None] & e_ok[None, :],
                other=0.0)
    return tl.dot(h, w, acc)


@triton.jit
def _y_tile(acc, r0, ro, o_ok, acc_ptr, bd_ptr, y_ptr, sy_m, sy_k, M, KO,
            DIRECT: tl.constexpr, HAS_BD: tl.constexpr, MT: tl.constexpr):
    """Rows [r0, r0 + MT) of the program's output tile: y (DIRECT) or fp32 atomics into acc."""
    rm = r0 + tl.arange(0, MT)
    out = (rm < M)[:, None] & o_ok[None, :]
    if DIRECT:
        if HAS_BD:
            acc += tl.load(bd_ptr + ro, mask=o_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * sy_m + ro[None, :] * sy_k, acc.to(y_ptr.dtype.element_ty),
                 mask=out)
    else:
        tl.atomic_add(acc_ptr + rm.to(tl.int64)[:, None] * KO + ro[None, :], acc, mask=out, sem="relaxed")


@triton.jit
def _out_tiles(a0, a1, a2, a3, a4, a5, a6, a7, ro, o_ok, acc_ptr, bd_ptr, y_ptr, sy_m, sy_k, M, KO,
               DIRECT: tl.constexpr, HAS_BD: tl.constexpr, MT: tl.constexpr, NT: tl.constexpr):
    """``_y_tile`` for each of the NT row tiles."""
    _y_tile(a0, 0, ro, o_ok, acc_ptr, bd_ptr, y_ptr, sy_m, sy_k, M, KO, DIRECT, HAS_BD, MT)
    if NT > 1:
        _y_tile(a1, MT, ro, o_ok, acc_ptr, bd_ptr, y_ptr, sy_m, sy_k, M, KO, DIRECT, HAS_BD, MT)
    if NT > 2:
        _y_tile(a2, 2 * MT, ro, o_ok, acc_ptr, bd_ptr, y_ptr, sy_m, sy_k, M, KO, DIRECT, HAS_BD, MT)
        _y_tile(a3, 3 * MT, ro, o_ok, acc_ptr, bd_ptr, y_ptr, sy_m, sy_k, M, KO, DIRECT, HAS_BD, MT)
    if NT > 4:
        _y_tile(a4, 4 * MT, ro, o_ok, acc_ptr, bd_ptr, y_ptr, sy_m, sy_k, M, KO, DIRECT, HAS_BD, MT)
        _y_tile(a5, 5 * MT, ro, o_ok, acc_ptr, bd_ptr, y_ptr, sy_m, sy_k, M, KO, DIRECT, HAS_BD, MT)
        _y_tile(a6, 6 * MT, ro, o_ok, acc_ptr, bd_ptr, y_ptr, sy_m, sy_k, M, KO, DIRECT, HAS_BD, MT)
        _y_tile(a7, 7 * MT, ro, o_ok, acc_ptr, bd_ptr, y_ptr, sy_m, sy_k, M, KO, DIRECT, HAS_BD, MT)


@triton.jit
def decode_union2_down_kernel(
    lc_ptr, ci_ptr, h_ptr, wdt_ptr, swd_n, swd_k, acc_ptr, bd_ptr, y_ptr, sy_m, sy_k,
    cnt_ptr, hsa_ptr, tok_ptr, hsum_ptr, st_ptr,
    M, N, KO, NB,
    DIRECT: tl.constexpr, HAS_BD: tl.constexpr, HAS_ST: tl.constexpr, NBP: tl.constexpr,
    BO: tl.constexpr, CD: tl.constexpr, MT: tl.constexpr, NT: tl.constexpr, CB: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid_o = tl.program_id(0)
    pid_s = tl.program_id(1)
    ns = tl.num_programs(1)
    ro = pid_o * BO + tl.arange(0, BO)
    o_ok = ro < KO
    rb = tl.arange(0, NBP)
    total = tl.sum(tl.load(lc_ptr + rb, mask=rb < NB, other=0), axis=0)   # the union's size
    nch = (total + CD - 1) // CD
    c0 = pid_s * nch // ns
    c1 = (pid_s + 1) * nch // ns
    re = tl.arange(0, CD)
    a0 = tl.zeros((MT, BO), dtype=tl.float32)
    a1 = tl.zeros((MT, BO), dtype=tl.float32)
    a2 = tl.zeros((MT, BO), dtype=tl.float32)
    a3 = tl.zeros((MT, BO), dtype=tl.float32)
    a4 = tl.zeros((MT, BO), dtype=tl.float32)
    a5 = tl.zeros((MT, BO), dtype=tl.float32)
    a6 = tl.zeros((MT, BO), dtype=tl.float32)
    a7 = tl.zeros((MT, BO), dtype=tl.float32)
    for j in range(c0, c1):
        e = j * CD + re
        e_ok = e < total
        n = tl.load(ci_ptr + e, mask=e_ok, other=0).to(tl.int64)
        # one W_d^T tile for every row tile of the program
        w = tl.load(wdt_ptr + n[:, None] * swd_n + ro[None, :] * swd_k, mask=e_ok[:, None] & o_ok[None, :],
                    other=0.0)
        a0 = _hdot(h_ptr, N, 0, e, e_ok, w, a0, M, MT)
        if NT > 1:
            a1 = _hdot(h_ptr, N, MT, e, e_ok, w, a1, M, MT)
        if NT > 2:
            a2 = _hdot(h_ptr, N, 2 * MT, e, e_ok, w, a2, M, MT)
            a3 = _hdot(h_ptr, N, 3 * MT, e, e_ok, w, a3, M, MT)
        if NT > 4:
            a4 = _hdot(h_ptr, N, 4 * MT, e, e_ok, w, a4, M, MT)
            a5 = _hdot(h_ptr, N, 5 * MT, e, e_ok, w, a5, M, MT)
            a6 = _hdot(h_ptr, N, 6 * MT, e, e_ok, w, a6, M, MT)
            a7 = _hdot(h_ptr, N, 7 * MT, e, e_ok, w, a7, M, MT)
    if DIRECT:
        _out_tiles(a0, a1, a2, a3, a4, a5, a6, a7, ro, o_ok, acc_ptr, bd_ptr, y_ptr, sy_m, sy_k, M, KO,
                   True, HAS_BD, MT, NT)
        if (pid_o == 0) & (pid_s == 0):
            finish_counts(cnt_ptr, hsa_ptr, tok_ptr, hsum_ptr, st_ptr, M, HAS_ST, CB)
    elif c1 > c0:
        _out_tiles(a0, a1, a2, a3, a4, a5, a6, a7, ro, o_ok, acc_ptr, bd_ptr, y_ptr, sy_m, sy_k, M, KO,
                   False, HAS_BD, MT, NT)
