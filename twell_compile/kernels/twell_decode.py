"""Triton device code: the decode path (few tokens, M <= 64), after cuBLAS's gate GEMV.

At decode sizes the FFN is memory-bound: dense reads W_gate, W_up and W_down in full. Here
W_gate is read in full by cuBLAS (g = x W_g^T + b_g, eager's own call and rounding); W_up rows
and W_down^T rows ([N, K_out] layout, made once per weight by ``weight_cache``) are read only
for neurons active in at least one row.

``decode_ffn_kernel`` (grid: N / CH neuron chunks x row blocks of MB x KSPLIT output splits):
  v = relu(g[rows, chunk]) (NaN kept); a column is active when any row has v != 0 (NaN
  counts). Then over K: u = x W_u[active rows]^T (+ b_u) with tl.dot (masked-off weight rows
  are never fetched), and per x row a NaN/Inf check (sum of x * 0). A row of x holding NaN/Inf
  makes every column active (second pass over K, rare), so the result equals dense
  (0 * Inf = NaN). h = v * u in fp32, rounded to x's dtype for the down product; if the chunk
  has an active column, y_acc[rows, split] += h @ W_d^T[chunk, split] by fp32 atomics (relaxed,
  y_acc zero on entry). Split 0 also writes per (chunk, row) the non-zero count of v and
  per (chunk, row block) sum |h|.
``decode_finish_kernel``: y = y_acc + b_d, cast; one extra program sums the counts into
  non-zeros per token (tok[:M]) and their total (tok[M], the policy's probe) and sum |h|.
The atomics make the last bits of y depend on the order programs finish (fp32 sums in varying
order); the error bound does not change.
"""

import triton
import triton.language as tl


@triton.jit
def decode_ffn_kernel(
    x_ptr, sx_m, sx_k, g_ptr, sg_m,
    wu_ptr, swu_n, swu_k, bu_ptr,
    wdt_ptr, swd_n, swd_k,
    acc_ptr, cnt_ptr, hs_ptr,
    M, K, N, KO, KSPLIT_LEN,
    GATED: tl.constexpr, HAS_BU: tl.constexpr,
    MB: tl.constexpr, CH: tl.constexpr, BK: tl.constexpr, BKO: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * CH + tl.arange(0, CH)
    n_ok = rn < N
    rm = pid_m * MB + tl.arange(0, MB)
    m_ok = rm < M
    valid = m_ok[:, None] & n_ok[None, :]
    dt = x_ptr.dtype.element_ty

    gv = tl.load(g_ptr + rm.to(tl.int64)[:, None] * sg_m + rn[None, :], mask=valid, other=0.0).to(tl.float32)
    v = tl.where(gv < 0.0, 0.0, gv)                        # relu as eager rounds g; NaN kept
    nz = (v != 0.0) & valid                                # NaN != 0: counted
    col = tl.max(nz.to(tl.int32), axis=0) > 0              # [CH]: active in any row

    # up projection for active columns, and the NaN/Inf check of this row block of x
    rk = tl.arange(0, BK)
    xbase = x_ptr + rm.to(tl.int64)[:, None] * sx_m
    wu_base = wu_ptr + rn.to(tl.int64)[:, None] * swu_n
    u = tl.zeros((MB, CH), dtype=tl.float32)
    nonfin = tl.zeros((MB,), dtype=tl.float32)             # sum of x * 0: NaN iff a NaN/Inf entry
    for k0 in range(0, K, BK):
        kk = k0 + rk
        k_ok = kk < K
        xk = tl.load(xbase + kk[None, :] * sx_k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        nonfin += tl.sum(xk.to(tl.float32) * 0.0, axis=1)
        if GATED:
            w = tl.load(wu_base + kk[None, :] * swu_k, mask=col[:, None] & k_ok[None, :], other=0.0)
            u = tl.dot(xk, tl.trans(w), u)
    if tl.sum((nonfin != nonfin).to(tl.int32), axis=0) > 0:
        # a row of x holds NaN/Inf: every column is active, as in dense (rare, exactness only)
        col = n_ok
        if GATED:
            u = tl.zeros((MB, CH), dtype=tl.float32)
            for k0 in range(0, K, BK):
                kk = k0 + rk
                k_ok = kk < K
                xk = tl.load(xbase + kk[None, :] * sx_k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(wu_base + kk[None, :] * swu_k, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                u = tl.dot(xk, tl.trans(w), u)
    if GATED:
        if HAS_BU:
            u += tl.load(bu_ptr + rn, mask=col, other=0.0).to(tl.float32)[None, :]
        h = v * u
    else:
        h = v
    h = tl.where(valid & col[None, :], h, 0.0)
    if pid_k == 0:
        tl.store(cnt_ptr + pid_n * M + rm, tl.sum(nz.to(tl.int32), axis=1), mask=m_ok)
        tl.store(hs_ptr + pid_n * tl.num_programs(1) + pid_m, tl.sum(tl.sum(tl.abs(h), axis=1), axis=0))

    # down projection: this chunk's active W_d^T rows, output columns of split pid_k
    if tl.sum(col.to(tl.int32), axis=0) > 0:
        hb = h.to(dt)
        ko_lo = pid_k * KSPLIT_LEN
        ko_hi = tl.minimum(KO, ko_lo + KSPLIT_LEN)
        rko = tl.arange(0, BKO)
        wd_base = wdt_ptr + rn.to(tl.int64)[:, None] * swd_n
        abase = acc_ptr + rm.to(tl.int64)[:, None] * KO
        for k0 in range(ko_lo, ko_hi, BKO):
            ko = k0 + rko
            o_ok = ko < ko_hi
            w = tl.load(wd_base + ko[None, :] * swd_k, mask=col[:, None] & o_ok[None, :], other=0.0)
            part = tl.dot(hb, w)
            tl.atomic_add(abase + ko[None, :], part, mask=m_ok[:, None] & o_ok[None, :], sem="relaxed")


@triton.jit
def decode_finish_kernel(
    acc_ptr, bd_ptr, y_ptr, sy_m, sy_k,
    cnt_ptr, hs_ptr, tok_ptr, hsum_ptr,
    M, KO, NB, NHS,
    HAS_BD: tl.constexpr, BLOCK: tl.constexpr, M_P: tl.constexpr, NB_CH: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < tl.cdiv(M * KO, BLOCK):
        idx = pid * BLOCK + tl.arange(0, BLOCK)
        ok = idx < M * KO
        acc = tl.load(acc_ptr + idx, mask=ok, other=0.0)
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
        for b0 in range(0, NB, NB_CH):
            bb = b0 + bb0
            c = tl.load(cnt_ptr + bb[:, None] * M + rm[None, :], mask=(bb < NB)[:, None] & m_ok[None, :], other=0)
            tot += tl.sum(c, axis=0)
        hs = tl.zeros((NB_CH,), dtype=tl.float32)
        for b0 in range(0, NHS, NB_CH):
            bb = b0 + bb0
            hs += tl.load(hs_ptr + bb, mask=bb < NHS, other=0.0)
        tl.store(tok_ptr + rm, tot, mask=m_ok)
        tl.store(tok_ptr + M, tl.sum(tot, axis=0))
        tl.store(hsum_ptr, tl.sum(hs, axis=0))
