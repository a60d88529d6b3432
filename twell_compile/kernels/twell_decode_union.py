"""Triton device code: the decode path's union form (two launches plus the finish; each weight
row of the batch's union read once for all tokens, on tensor cores).

For M of 16 and more rows the union of neurons active in some row is a large part of N (i.i.d.
d=0.005: 7.4% / 27% / 47% / 72% at M = 16 / 64 / 128 / 256), and the per-pair and per-block
forms read its W_up and W_d^T rows many times. Here every row of the union is read once:

``decode_union_up_kernel`` (grid: N / BN neuron blocks), one program per block, all M rows at
  once (MP = M padded to a power of two >= 16): g^T = W_g[block] x^T + b_g over all of K
  ([BN, MP] fp32, tl.dot; the block's W_gate rows read once), v = relu(g) (NaN kept). A neuron
  is active when some row has v != 0 or a non-finite g (a row of x holding NaN/Inf makes its
  g non-finite, so the result propagates as dense's 0 * Inf does), as in ``gate_block``. Then
  u^T = W_u[active] x^T (+ b_u) by tl.dot with inactive W_up rows masked (never read), h =
  a(v) * b(u) (kernels/act.py; 0 off the active pairs) rounded to x's dtype as eager rounds h
  for the down GEMM. The block's active neurons go to its fixed slots [b * BN, b * BN + count)
  in neuron order: their indices (ln) and h rows over all MP rows (lh, x's dtype, rows past M
  zero); count per block (lc) is written, not added, so nothing needs zeroing between calls.
  Statistics (non-zeros per row, sum |h|) are added into the call's counters (``add_stats``).
``decode_union_down_kernel`` (grid: K_out / BO column tiles x S splits x row tiles of MT rows):
  program (o, s, r) prefix-sums the per-block counts (the union's size and each slot's place
  in it), takes the s-th of S equal shares of the union's entries, C at a time: their neuron
  indices, h^T [C, MT] and W_d^T rows [C, BO] (gathered through the strides: contiguous rows
  when W_down is stored transposed), acc^T [BO, MT] += W_d^T^T h^T in fp32 (tl.dot; the
  dot's M side is BO, so BO <= 32 keeps it off Hopper's wgmma, see arch.MAX_MB). DIRECT
  (S == 1: one program per output tile): y = acc + b_d written in x's dtype, and program
  (0, 0, 0) reads the statistics counters (``finish_counts``): no atomics on y, no finish
  launch, the same bits on every call. Otherwise the S shares go into the fp32 accumulator
  [M, K_out] by relaxed atomics (S x M x K_out of them) and ``decode_finish_kernel``
  (twell_decode.py) writes y, the statistics and zeroes the accumulator again.
Every active neuron of the union is listed (capacity BN per block): exact at any density.
"""

import triton
import triton.language as tl

from twell_compile.kernels.act import gate_part, up_part
from twell_compile.kernels.pdl import pdl_enter
from twell_compile.kernels.twell_decode import add_stats, finish_counts


@triton.jit
def _dot_t(x_ptr, sx_m, sx_k, w_ptr, sw_n, sw_k, b_ptr, sel, rn, rm, m_ok, K,
           HAS_B: tl.constexpr, BN: tl.constexpr, MP: tl.constexpr, BK: tl.constexpr):
    """W[rn] x^T (+ b[rn]) [BN, MP] in fp32 by tl.dot over K in steps of BK, all rows of x at
    once; rows of W (and bias entries) outside ``sel`` are masked, so never read."""
    rk = tl.arange(0, BK)
    w_base = w_ptr + rn.to(tl.int64)[:, None] * sw_n
    x_base = x_ptr + rm.to(tl.int64)[None, :] * sx_m
    acc = tl.zeros((BN, MP), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        k_ok = kk < K
        w = tl.load(w_base + kk[None, :] * sw_k, mask=sel[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_base + kk[:, None] * sx_k, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        acc = tl.dot(w, xt, acc)
    if HAS_B:
        acc += tl.load(b_ptr + rn, mask=sel, other=0.0).to(tl.float32)[:, None]
    return acc


@triton.jit
def decode_union_up_kernel(
    x_ptr, sx_m, sx_k, wg_ptr, swg_n, swg_k, bg_ptr, wu_ptr, swu_n, swu_k, bu_ptr,
    ln_ptr, lh_ptr, lc_ptr, cnt_ptr, hsa_ptr,
    M, K, N,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr,
    BN: tl.constexpr, MP: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, ACT: tl.constexpr,
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    n_ok = rn < N
    rm = tl.arange(0, MP)
    m_ok = rm < M
    g = _dot_t(x_ptr, sx_m, sx_k, wg_ptr, swg_n, swg_k, bg_ptr, n_ok, rn, rm, m_ok, K, HAS_BG, BN, MP, BK)
    valid = n_ok[:, None] & m_ok[None, :]
    v = tl.where(g < 0.0, 0.0, g)
    nz = (v != 0.0) & valid                                   # NaN counted, as eager's count
    act = (nz | ~(tl.abs(g) < float("inf"))) & valid
    v = gate_part(v, ACT)                                    # a(relu(g)); nz, act: relu(g)'s
    ci = (tl.max(act.to(tl.int32), axis=1) > 0).to(tl.int32)    # [BN]: active in some row
    count = tl.sum(ci, axis=0)
    tl.store(lc_ptr + pid, count)
    hsum = tl.sum(tl.zeros((BN,), dtype=tl.float32), axis=0)
    if count > 0:
        col = ci > 0
        if GATED:
            u = _dot_t(x_ptr, sx_m, sx_k, wu_ptr, swu_n, swu_k, bu_ptr, col, rn, rm, m_ok, K, HAS_BU, BN, MP, BK)
            h = v * up_part(u, ACT)
        else:
            h = v
        h = tl.where(act, h, 0.0).to(x_ptr.dtype.element_ty)    # eager's rounding; rows past M: 0
        slot = (pid * BN + tl.cumsum(ci, axis=0) - 1).to(tl.int64)
        tl.store(ln_ptr + slot, rn, mask=col)
        tl.store(lh_ptr + slot[:, None] * MP + rm[None, :], h, mask=col[:, None])
        hsum = tl.sum(tl.sum(tl.abs(h.to(tl.float32)), axis=1), axis=0)
    add_stats(cnt_ptr, hsa_ptr, tl.trans(nz.to(tl.int32)), hsum, rm, m_ok)


@triton.jit
def decode_union_down_kernel(
    ln_ptr, lh_ptr, lc_ptr, wdt_ptr, swd_n, swd_k, acc_ptr, bd_ptr, y_ptr, sy_m, sy_k,
    cnt_ptr, hsa_ptr, tok_ptr, hsum_ptr, st_ptr,
    M, KO, NB,
    DIRECT: tl.constexpr, HAS_BD: tl.constexpr, HAS_ST: tl.constexpr, BN: tl.constexpr,
    MP: tl.constexpr, MT: tl.constexpr, NBP: tl.constexpr, BO: tl.constexpr, C: tl.constexpr,
    CB: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid_o = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_r = tl.program_id(2)
    ns = tl.num_programs(1)
    ro = pid_o * BO + tl.arange(0, BO)
    o_ok = ro < KO
    rt = pid_r * MT + tl.arange(0, MT)                      # rows; MT divides MP
    t_ok = rt < M
    rb = tl.arange(0, NBP)
    cnt = tl.load(lc_ptr + rb, mask=rb < NB, other=0)
    incl = tl.cumsum(cnt, axis=0)
    excl = incl - cnt
    total = tl.sum(cnt, axis=0)                             # the union's size
    nch = (total + C - 1) // C
    c0 = pid_s * nch // ns
    c1 = (pid_s + 1) * nch // ns
    re = tl.arange(0, C)
    acc = tl.zeros((BO, MT), dtype=tl.float32)
    for j in range(c0, c1):
        e = j * C + re                                      # entries of the union
        e_ok = e < total
        b = tl.sum((incl[None, :] <= e[:, None]).to(tl.int32), axis=1)        # entry's block
        off = e - tl.sum(tl.where(rb[None, :] == b[:, None], excl[None, :], 0), axis=1)
        slot = (b * BN + off).to(tl.int64)
        n = tl.load(ln_ptr + slot, mask=e_ok, other=0).to(tl.int64)
        h = tl.load(lh_ptr + slot[:, None] * MP + rt[None, :], mask=e_ok[:, None], other=0.0)
        w = tl.load(wdt_ptr + n[:, None] * swd_n + ro[None, :] * swd_k, mask=e_ok[:, None] & o_ok[None, :],
                    other=0.0)
        acc = tl.dot(tl.trans(w), h, acc)
    out = o_ok[:, None] & t_ok[None, :]
    if DIRECT:
        if HAS_BD:
            acc += tl.load(bd_ptr + ro, mask=o_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + rt.to(tl.int64)[None, :] * sy_m + ro[:, None] * sy_k, acc.to(y_ptr.dtype.element_ty),
                 mask=out)
        if (pid_o == 0) & (pid_r == 0):
            finish_counts(cnt_ptr, hsa_ptr, tok_ptr, hsum_ptr, st_ptr, M, HAS_ST, CB)
    elif c1 > c0:
        tl.atomic_add(acc_ptr + rt.to(tl.int64)[None, :] * KO + ro[:, None], acc, mask=out, sem="relaxed")
