"""Triton device code: the decode path's union2 form (the gate as one GEMM, then three small
launches over the batch's union of active neurons, plus the finish).

Built around bytes. For M >= 16 rows the union of neurons active in some row is a large part of
N (i.i.d. d=0.005: 7.4% / 27% / 47% / 72% at M = 16 / 64 / 128 / 256), so W_gate is read in full
once, W_up and W_d^T only on the union's rows, each row once for all M tokens, and everything
else stays small: a tile of C weight rows and R token rows moves (C + R) x BK x 2 bytes per K
step, so x (or h) read again per program costs M / C times the weight bytes; programs run over
chunks of the COMPACTED union (their count follows the union, each gathered row is live) and
keep all M rows inside the program: NT row tiles of MT rows (NT chosen at launch from M, powers
of two) form one fp32 accumulator of NT MT rows, rows past M masked, so each weight tile feeds
one tl.dot of all the rows (its M side is NT MT: 64 rows and more select Hopper's wgmma, see
arch.MAX_MB).

The gate, g = x W_g^T + b_g [M, N] in x's dtype, is the host's cuBLAS call (cuda_decode; eager's
own call, so g and the active set are eager's bits). Then:

``decode_union2_list_kernel`` (grid: N / BL neuron blocks): reads the block's g for all rows in
  row tiles, a neuron is in the union when some row has relu(g) != 0 or a non-finite g (a row
  of x holding NaN/Inf makes its g non-finite, so the result propagates as dense's 0 * Inf
  does); writes the block's count (lc, written, not added: nothing to zero) and its union
  neurons in neuron order to the block's fixed slots [b BL, b BL + count) (ln). Adds the
  non-zeros of relu(g) per row into the call's counters.
``decode_union2_up_kernel`` (grid: row groups of MR rows x N / C chunks; programs past the
  union's size exit): program (r, j) prefix-sums the NB block counts (the union's size U and
  each slot's place), maps union entries [j C, j C + C) to neurons, and computes u^T for its C
  gathered W_up rows and its MR = NT MT rows: per K step one [C, BK] W_up tile and one x tile
  [MR, BK], one dot into the accumulator [MR, C] (W_up read once for all rows when MR is all
  of M). h = a(relu(g)) b(u + b_u) (kernels/act.py; 0 off the active pairs) rounded to x's
  dtype as eager rounds h; written compactly h[m, e] ([M, N] scratch, row-major: entry e of
  the union in column e) with the compact neuron list ci[e]. DENSE_UP: u is read from a dense
  cuBLAS up projection [M, N] instead of the dot (the whole W_up read; for large unions).
  Adds sum |h| into the call's counter.
``decode_union2_down_kernel`` (grid: K_out / BO tiles x S splits of the union): program (o, s)
  takes the s-th of S equal shares of the union, CD entries at a time: W_d^T rows [CD, BO]
  gathered by ci (contiguous rows when W_down is stored transposed) once and the h tile of all
  NT MT rows [NT MT, CD], one dot into the accumulator [NT MT, BO]; h is read K_out / BO times
  in all. DIRECT (S == 1): y = acc + b_d in x's dtype, program (0, 0) reads the statistics
  counters (``finish_counts``), no finish launch.
  Otherwise relaxed fp32 atomics into the accumulator (S x M x K_out) and
  ``decode_finish_kernel`` (twell_decode.py) writes y, the statistics and zeroes it again.
Every neuron of the union is listed (capacity N): exact at any density.
"""

import triton
import triton.language as tl

from twell_compile.kernels.act import gate_part, up_part
from twell_compile.kernels.twell_decode import finish_counts, pdl_enter


@triton.jit
def decode_union2_list_kernel(g_ptr, ln_ptr, lc_ptr, cnt_ptr, M, N,
                              BL: tl.constexpr, RT: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    rn = pid * BL + tl.arange(0, BL)
    n_ok = rn < N
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
def decode_union2_up_kernel(
    x_ptr, sx_m, sx_k, wu_ptr, swu_n, swu_k, bu_ptr, g_ptr, u_ptr,
    ln_ptr, lc_ptr, ci_ptr, h_ptr, hsa_ptr,
    M, K, N, NB,
    GATED: tl.constexpr, HAS_BU: tl.constexpr, DENSE_UP: tl.constexpr, UP_DOT: tl.constexpr,
    BL: tl.constexpr, NBP: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, MT: tl.constexpr, NT: tl.constexpr, PDL: tl.constexpr,
    ACT: tl.constexpr,
):
    pdl_enter(PDL)
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
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
        if pid_r == 0:
            tl.store(ci_ptr + e, n, mask=e_ok)                # the compact list for the down launch
        rm = pid_r * (NT * MT) + tl.arange(0, NT * MT)        # the program's rows, all in one tile
        m_ok = rm < M
        rows = rm.to(tl.int64)[:, None]
        acc = tl.zeros((NT * MT, C), dtype=tl.float32)
        if UP_DOT:
            rk = tl.arange(0, BK)
            w_base = wu_ptr + n.to(tl.int64)[:, None] * swu_n
            for k0 in range(0, K, BK):
                kk = k0 + rk
                k_ok = kk < K
                # one W_up tile for all the program's rows
                wt = tl.trans(tl.load(w_base + kk[None, :] * swu_k, mask=e_ok[:, None] & k_ok[None, :], other=0.0))
                xk = tl.load(x_ptr + rows * sx_m + kk[None, :] * sx_k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                acc = tl.dot(xk, wt, acc)
        # h = a(relu(g)) b(u + b_u), 0 off the active pairs, written compactly at h[m, e]
        ok = m_ok[:, None] & e_ok[None, :]
        g = tl.load(g_ptr + rows * N + n[None, :], mask=ok, other=0.0).to(tl.float32)
        v = tl.where(g < 0.0, 0.0, g)
        act = ((v != 0.0) | ~(tl.abs(g) < float("inf"))) & ok
        v = gate_part(v, ACT)
        if GATED:
            if DENSE_UP:                                      # eager's u (bias included), x's dtype
                u = tl.load(u_ptr + rows * N + n[None, :], mask=ok, other=0.0).to(tl.float32)
            else:
                u = acc
                if HAS_BU:
                    u += tl.load(bu_ptr + n, mask=e_ok, other=0.0).to(tl.float32)[None, :]
            h = v * up_part(u, ACT)
        else:
            h = v
        h = tl.where(act, h, 0.0).to(h_ptr.dtype.element_ty)  # eager's rounding
        tl.store(h_ptr + rows * N + e[None, :], h, mask=ok)
        hsum = tl.sum(tl.sum(tl.abs(h.to(tl.float32)), axis=1), axis=0)
        if hsum != 0.0:       # NaN too
            tl.atomic_add(hsa_ptr, hsum, sem="relaxed")


@triton.jit
def _union_share(lc_ptr, NB, NBP: tl.constexpr, CD: tl.constexpr):
    """(U, j0, j1): the union's size U (the sum of the NB block counts) and the chunks [j0, j1)
    of CD entries that make this program's share, the program_id(1)-th of num_programs(1)
    equal shares of the union."""
    rb = tl.arange(0, NBP)
    total = tl.sum(tl.load(lc_ptr + rb, mask=rb < NB, other=0), axis=0)
    nch = (total + CD - 1) // CD
    s = tl.program_id(1)
    ns = tl.num_programs(1)
    return total, s * nch // ns, (s + 1) * nch // ns


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
    total, c0, c1 = _union_share(lc_ptr, NB, NBP, CD)
    ro = tl.program_id(0) * BO + tl.arange(0, BO)
    o_ok = ro < KO
    rm = tl.arange(0, NT * MT)                                # all M rows, in one tile
    m_ok = rm < M
    h_base = h_ptr + rm.to(tl.int64)[:, None] * N
    re = tl.arange(0, CD)
    acc = tl.zeros((NT * MT, BO), dtype=tl.float32)
    for j in range(c0, c1):
        e = j * CD + re
        e_ok = e < total
        n = tl.load(ci_ptr + e, mask=e_ok, other=0).to(tl.int64)
        # one W_d^T tile for all the rows
        w = tl.load(wdt_ptr + n[:, None] * swd_n + ro[None, :] * swd_k, mask=e_ok[:, None] & o_ok[None, :],
                    other=0.0)
        h = tl.load(h_base + e[None, :], mask=m_ok[:, None] & e_ok[None, :], other=0.0)
        acc = tl.dot(h, w, acc)
    out = m_ok[:, None] & o_ok[None, :]
    if DIRECT:
        if HAS_BD:
            acc += tl.load(bd_ptr + ro, mask=o_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * sy_m + ro[None, :] * sy_k, acc.to(y_ptr.dtype.element_ty),
                 mask=out)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            finish_counts(cnt_ptr, hsa_ptr, tok_ptr, hsum_ptr, st_ptr, M, HAS_ST, CB)
    elif c1 > c0:
        tl.atomic_add(acc_ptr + rm.to(tl.int64)[:, None] * KO + ro[None, :], acc, mask=out, sem="relaxed")
