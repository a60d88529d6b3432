"""Triton device code: the per-row TwELL path (the gate GEMM, then these kernels).

``compact_rows_kernel``: one light pass over the gate pre-activation g [M, N] (cuBLAS output).
BM rows per program, CH columns per step; v = relu(g) (NaN kept), and per row, straight from
registers with a running prefix count:

    cnt[m]        non-zeros of the row (NaN counts; may exceed W)
    list[m, :W]   its first W non-zeros in column order, int32 (column << 16) | bits(value)
                  (N <= 65536; slots >= cnt left unwritten)
    order         the rows by cost, longest first (no sort): NB buckets, rows with cnt > W
                  in bucket 0, the others by cnt / (W + 1) in NB - 1 equal bins, heaviest
                  first; bucket b's rows at order[b * M : b * M + ctr[b]] (NB atomic counters).
                  The row kernels take rows in this order (``row_at``): the long chains of the
                  exact tail and the longest lists start first, and the last wave holds the
                  shortest rows instead of waiting on a long one

``merge_tiles_kernel``: the same lists, counts and order from the packed tiles that the fused
gate GEMM (twell::gate_pack, csrc/gate_pack.cuh) writes in its epilogue, in place of the pass
over g.

``twell_rows_kernel``: one program per token row (the p-th in ``order``), x row and y row in registers, h never in
global memory:
  1. list loop: pairs list[m, p] for p < min(cnt, W), PAIRS per iteration, the
     next pairs' (col, value) loaded one iteration ahead (PF=1) or also their weight rows
     (PF=2), or the loop software-pipelined by Triton (PF=3: list entries and weight rows of
     the next STAGES - 1 steps copied to shared memory with cp.async while this one computes);
     per pair u = x . W_u[n] (+ b_u), h = g * u (or the activation ACT's h from relu(g) and
     u: kernels/act.py), y += h * W_d^T[n].
  2. exact tail: rows with cnt > W continue over g itself after the W-th listed column
     (chunks of CH, non-zeros found with a prefix count); rows whose x holds NaN/Inf take
     every column (0 * Inf = NaN as in eager). Nothing is dropped, no capacity to exhaust.
Also writes sum |h| per row (stats), in fp32.
  3. split rows (SPLIT > 1): a program per row waits on its longest row's chain of pairs, and a
     trained layer's rows are skewed (6-169 listed pairs at 34 on average). The H heaviest rows in
     the order take SPLIT programs each: a row over SEG listed pairs whose whole bucket lies in
     those H is cut in up to SPLIT even parts, each part sums its pairs into an fp32 slot, and
     the last part to arrive adds the slots in part order and writes y (deterministic: which
     rows split and how does not depend on the order within a bucket; the exact tail stays
     with part 0).
compact_rows_kernel and twell_rows_kernel take PDL: launched with programmatic dependent launch
(kernels/pdl.py), each waits on the previous kernel before touching memory.
"""

import triton
import triton.language as tl

from twell_compile.kernels.act import hidden
from twell_compile.kernels.pairs import pick, scan, select
from twell_compile.kernels.pdl import pdl_enter
from twell_compile.kernels.transpose import transpose_tile_at


@triton.jit
def _store_b32(addr, val, mask, ASM: tl.constexpr):
    """Predicated 32-bit stores at byte addresses addr (int64), in the operands' own layout.

    tl.store with rank-scattered pointers made Triton convert the whole [BM, CH] tile (64-bit
    pointers included) through shared memory for a sizePerThread=1 layout: 20 barriers per
    step, 0.29 ms for g [16384, 5632] on H200. Inline PTX is elementwise: no conversion.
    ASM=False (interpreter): plain tl.store."""
    if ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r,r", [addr, val, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(addr.to(tl.pointer_type(tl.int32)), val, mask=mask)


@triton.jit
def row_at(order_ptr, ctr_ptr, p, M, NB: tl.constexpr):
    """The p-th row in the compaction's order: bucket by bucket, heaviest first."""
    idx = p * 0
    rem = p
    found = p < 0
    for b in tl.static_range(NB):
        c = tl.load(ctr_ptr + b)
        take = (rem < c) & (~found)
        idx = tl.where(take, b * M + rem, idx)
        rem = tl.where(found | take, rem, rem - c)
        found = found | take
    return tl.load(order_ptr + idx).to(tl.int64)


@triton.jit
def bucket_end(ctr_ptr, p, NB: tl.constexpr):
    """The position just past the last row of the bucket that holds the p-th row in order."""
    end = p * 0
    found = p < 0
    for b in tl.static_range(NB):
        end = tl.where(found, end, end + tl.load(ctr_ptr + b))
        found = found | (p < end)
    return end


@triton.jit
def _compact_chunks(g_ptr, sg_m, list_ptr, rm, m_ok, N, W, CH: tl.constexpr, STAGES: tl.constexpr,
                    ASM: tl.constexpr):
    """One pass over rows rm of g: list[m, r] for the r-th non-zero of relu(g), r < W. Returns
    the rows' non-zero counts."""
    ci = tl.arange(0, CH)
    gbase = g_ptr + rm.to(tl.int64)[:, None] * sg_m
    lbase = list_ptr.to(tl.int64) + rm.to(tl.int64)[:, None] * (W * 4)
    run = tl.zeros(rm.shape, dtype=tl.int32)
    for c0 in tl.range(0, N, CH, num_stages=STAGES):     # STAGES > 1: later chunks' loads in flight
        cn = c0 + ci
        ok = m_ok[:, None] & (cn < N)[None, :]
        gv = tl.load(gbase + cn[None, :], mask=ok, other=0.0)
        v = tl.where(gv < 0.0, 0.0, gv).to(g_ptr.dtype.element_ty)  # relu, NaN kept
        nz = (v != 0.0) & ok                                 # NaN != 0: counted
        nzi = nz.to(tl.int32)
        rank = run[:, None] + tl.cumsum(nzi, axis=1) - nzi
        keep = nz & (rank < W)
        bits = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        _store_b32(lbase + rank.to(tl.int64) * 4, (cn[None, :] << 16) | bits, keep, ASM)
        run += tl.sum(nzi, axis=1)
    return run


@triton.jit
def _file_rows(order_ptr, ctr_ptr, rm, m_ok, run, M, W, NB: tl.constexpr):
    """The rows' places in the row kernels' order. Bucket 0: rows over W (their tail scans g: a
    chain of ~N / CH + cnt - W steps); then the rest by count, heaviest first, so the row kernels
    start the longest rows first."""
    if NB == 1:
        bkt = tl.zeros(rm.shape, dtype=tl.int32)
    else:
        lite = (NB - 2) - (run.to(tl.int64) * (NB - 1) // (W + 1)).to(tl.int32)
        bkt = tl.where(run > W, 0, 1 + tl.maximum(lite, 0))
    for b in tl.static_range(NB):
        inb = (bkt == b) & m_ok
        ib = inb.to(tl.int32)
        base = tl.atomic_add(ctr_ptr + b, tl.sum(ib, axis=0))
        pos = b * M + base + tl.cumsum(ib, axis=0) - ib
        tl.store(order_ptr + pos, rm, mask=inb)


@triton.jit
def compact_rows_kernel(g_ptr, sg_m, list_ptr, cnt_ptr, order_ptr, ctr_ptr, M, N, W,
                        wd_ptr, wdt_ptr, TR, TC, s_r, s_c, NC,
                        BM: tl.constexpr, CH: tl.constexpr, NB: tl.constexpr, STAGES: tl.constexpr,
                        ASM: tl.constexpr, PDL: tl.constexpr, TRANSPOSE: tl.constexpr = False,
                        TB: tl.constexpr = 64):
    """list[m, r] = (column << 16) | bits(relu(g)[m, column]) for the r-th non-zero, r < W;
    order [NB * M]: the rows by bucket, heaviest first (ctr: NB zeroed int32 counters). PDL:
    launched with programmatic dependent launch (kernels/pdl.py).

    TRANSPOSE: programs from NC on write wdt = wd^T (wd [TR, TC], strides s_r, s_c), one TB x TB
    tile each, in the same launch: the compaction's programs wait on their chains of column
    loads while the tiles move bytes, instead of a transpose kernel of its own after them."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    if TRANSPOSE and pid >= NC:
        transpose_tile_at(wd_ptr, wdt_ptr, TR, TC, s_r, s_c, pid - NC, TB)
    else:
        rm = pid * BM + tl.arange(0, BM)
        m_ok = rm < M
        run = _compact_chunks(g_ptr, sg_m, list_ptr, rm, m_ok, N, W, CH, STAGES, ASM)
        tl.store(cnt_ptr + rm, run, mask=m_ok)
        _file_rows(order_ptr, ctr_ptr, rm, m_ok, run, M, W, NB)


@triton.jit
def _rebuild_rows(packed_ptr, tcnt_ptr, g_ptr, sg_m, rm, need, N, T, TN, S: tl.constexpr, S_P: tl.constexpr,
                  CT: tl.constexpr, CH: tl.constexpr):
    """g's rows rm where ``need``, made relu-exact from the packed slots where the gate GEMM did
    not write them (g="spills": it wrote the row tiles over their slots and those holding a
    non-finite value): each row tile within its slots (tcnt <= S, all its non-zeros in the
    slots) zeroed, then its slots' values stored. relu(g) is then g's at every column, which is
    all that _compact_chunks and the row kernel's exact tail read (both take relu(g)). The
    barriers order this program's stores before its own later loads."""
    r64 = rm.to(tl.int64)[:, None]
    dt = g_ptr.dtype.element_ty
    ci = tl.arange(0, CH)
    for c0 in range(0, N, CH):
        cn = c0 + ci
        ok = need[:, None] & (cn < N)[None, :]
        tc = tl.load(tcnt_ptr + r64 * T + (cn // TN)[None, :], mask=ok, other=0)
        tl.store(g_ptr + r64 * sg_m + cn[None, :], tl.zeros((rm.shape[0], CH), dtype=dt), mask=ok & (tc <= S))
    tl.debug_barrier()
    ct = tl.arange(0, CT)
    ss = tl.arange(0, S_P)[None, None, :]
    for t0 in range(0, T, CT):
        t = t0 + ct
        tcs = tl.load(tcnt_ptr + r64 * T + t[None, :], mask=need[:, None] & (t < T)[None, :], other=0)
        live = (ss < tcs[:, :, None]) & (tcs[:, :, None] <= S)
        slot = (r64 * T + t[None, :]).to(tl.int64)[:, :, None] * S + ss
        v = tl.load(packed_ptr + slot, mask=live, other=0)
        col = ((v >> 16) & 0xFFFF).to(tl.int64)
        val = (v & 0xFFFF).to(tl.int16).to(dt, bitcast=True)
        tl.store(g_ptr + r64[:, :, None] * sg_m + col, val, mask=live)
    tl.debug_barrier()


@triton.jit
def merge_tiles_kernel(packed_ptr, tcnt_ptr, g_ptr, sg_m, list_ptr, cnt_ptr, order_ptr, ctr_ptr, M, N, W, T, TN,
                       wd_ptr, wdt_ptr, TR, TC, s_r, s_c, NC,
                       S: tl.constexpr, S_P: tl.constexpr, T_P: tl.constexpr, CT: tl.constexpr, BM: tl.constexpr,
                       REBUILD: tl.constexpr, CH: tl.constexpr, NB: tl.constexpr, STAGES: tl.constexpr,
                       ASM: tl.constexpr, PDL: tl.constexpr = False, TRANSPOSE: tl.constexpr = False,
                       TB: tl.constexpr = 64):
    """compact_rows_kernel's outputs from the gate GEMM's packed tiles (twell::gate_pack): a
    row's tiles CT at a time, as a [BM, CT, S_P] block of slots (S_P: S to a power of 2); slot s
    of tile t is live where s < tcnt[m, t] and goes to list[m, P_t + s] while < W (P_t: the non-zeros of the row's tiles
    before t, a running prefix count over the counts alone). Per step one load of the counts and
    one of the live slots (masked: a dead slot moves no bytes), no scan over the slots. Reads
    the counts and the slots, not g. A block holding a tile with more than S non-zeros (its
    slots keep only the first S) lists its rows from g itself, as compact_rows_kernel does:
    exact either way. REBUILD (g written only where the packing spilled, tiles of TN columns):
    such a block's rows, and rows over W (the row kernel's tail reads them), are rebuilt from
    the slots first (``_rebuild_rows``). TRANSPOSE: programs from NC on write wdt = wd^T, as in
    compact_rows_kernel. PDL: launched with programmatic dependent launch (kernels/pdl.py), as
    the compaction is, so the row kernel's launch overlaps this one."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    if TRANSPOSE and pid >= NC:
        transpose_tile_at(wd_ptr, wdt_ptr, TR, TC, s_r, s_c, pid - NC, TB)
    else:
        _merge_block(packed_ptr, tcnt_ptr, g_ptr, sg_m, list_ptr, cnt_ptr, order_ptr, ctr_ptr, M, N, W, T, TN,
                     pid, S, S_P, T_P, CT, BM, REBUILD, CH, NB, STAGES, ASM)


@triton.jit
def _merge_block(packed_ptr, tcnt_ptr, g_ptr, sg_m, list_ptr, cnt_ptr, order_ptr, ctr_ptr, M, N, W, T, TN, pid,
                 S: tl.constexpr, S_P: tl.constexpr, T_P: tl.constexpr, CT: tl.constexpr, BM: tl.constexpr,
                 REBUILD: tl.constexpr, CH: tl.constexpr, NB: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr):
    """merge_tiles_kernel's work for its block of rows pid * BM .. pid * BM + BM - 1."""
    rm = pid * BM + tl.arange(0, BM)
    m_ok = rm < M
    r64 = rm.to(tl.int64)[:, None]
    tt = tl.arange(0, T_P)
    tc = tl.load(tcnt_ptr + r64 * T + tt[None, :], mask=m_ok[:, None] & (tt < T)[None, :], other=0)
    spilled = tl.max(tl.max((tc > S).to(tl.int32), axis=1), axis=0)
    if spilled > 0:
        if REBUILD:
            _rebuild_rows(packed_ptr, tcnt_ptr, g_ptr, sg_m, rm, m_ok, N, T, TN, S, S_P, CT, CH)
        run = _compact_chunks(g_ptr, sg_m, list_ptr, rm, m_ok, N, W, CH, STAGES, ASM)
    else:
        run = tl.zeros(rm.shape, dtype=tl.int32)
        lbase = list_ptr.to(tl.int64) + r64 * (W * 4)
        ct = tl.arange(0, CT)
        ss = tl.arange(0, S_P)[None, None, :]          # (tcnt <= S here: ss < tcnt is in range)
        for t0 in range(0, T, CT):
            t = t0 + ct
            tcs = tl.load(tcnt_ptr + r64 * T + t[None, :], mask=m_ok[:, None] & (t < T)[None, :], other=0)
            start = run[:, None] + tl.cumsum(tcs, axis=1) - tcs
            live = ss < tcs[:, :, None]
            rank = start[:, :, None] + ss
            slot = (r64 * T + t[None, :]).to(tl.int64)[:, :, None] * S + ss
            v = tl.load(packed_ptr + slot, mask=live, other=0)
            _store_b32(lbase[:, :, None] + rank.to(tl.int64) * 4, v, live & (rank < W), ASM)
            run += tl.sum(tcs, axis=1)
        if REBUILD:
            over = (run > W) & m_ok
            if tl.max(over.to(tl.int32), axis=0) > 0:
                _rebuild_rows(packed_ptr, tcnt_ptr, g_ptr, sg_m, rm, over, N, T, TN, S, S_P, CT, CH)
    tl.store(cnt_ptr + rm, run, mask=m_ok)
    _file_rows(order_ptr, ctr_ptr, rm, m_ok, run, M, W, NB)


@triton.jit
def _unpack(pk, dtype):
    """(column int64, value fp32) from packed list entries."""
    n = ((pk >> 16) & 0xFFFF).to(tl.int64)
    g = (pk & 0xFFFF).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
    return n, g


@triton.jit
def _wrows(ptr, n, s_n, ks, s_k, live, k_mask, dummy, LOAD: tl.constexpr):
    """Weight rows n [PAIRS] x ks, in the weight dtype (dummy when not LOAD)."""
    if LOAD:
        return tl.load(ptr + n[:, None] * s_n + ks[None, :] * s_k, mask=live[:, None] & k_mask, other=0.0)
    else:
        return dummy


@triton.jit
def _pair(acc, hs, xr, g, n, live, wu, wd, bu_ptr, k_ok,
          GATED: tl.constexpr, HAS_BU: tl.constexpr, ACT: tl.constexpr):
    """y += h * W_d^T[n] for PAIRS pairs whose weight rows wu, wd are loaded (g: relu(g); h
    formed by the activation ACT, kernels/act.py)."""
    if GATED:
        u = tl.sum(wu.to(tl.float32) * xr[None, :], axis=1)
        if HAS_BU:
            u += tl.load(bu_ptr + n, mask=live, other=0.0).to(tl.float32)
        h = hidden(g, u, GATED, ACT)
    else:
        h = hidden(g, g, GATED, ACT)
    h = tl.where(live, h, 0.0)
    acc += tl.sum(h[:, None] * wd.to(tl.float32), axis=0)
    hs += tl.abs(h)
    return acc, hs


@triton.jit
def _split_range(nl, heavy, part, SEG: tl.constexpr, SPLIT: tl.constexpr):
    """A heavy row's nl listed pairs cut in s <= SPLIT even parts of about SEG or more, none
    empty (4 pairs in 3: 2 + 2); s = 1 for a row at most SEG long or not heavy. Returns (s, the
    part's first pair, its pair count: 0 for parts past s)."""
    s = tl.where(heavy & (nl > SEG), tl.minimum(tl.cdiv(nl, SEG), SPLIT), 1)
    seg = tl.cdiv(nl, s)
    s = tl.where(s > 1, tl.cdiv(nl, tl.maximum(seg, 1)), 1)
    lo = tl.minimum(part * seg, nl)
    return s, lo, tl.minimum(nl - lo, seg)


@triton.jit
def _join_parts(acc, hrow, part_ptr, tick_ptr, p, part, s, ko, H, KO, SPLIT: tl.constexpr):
    """A split row's parts meet here (only they call it: part < s, s > 1). Each stores its fp32
    sums in its slot of part_ptr (y's row in [H * SPLIT, KO], rows 16-byte aligned where KO is a
    multiple of 4; sum |h| in the [H * SPLIT] after them) and takes a ticket on the row's counter;
    the last to arrive adds the s slots in part order (the same sum whichever program finishes
    last). Returns (y's sums, sum |h|, whether this program writes the row: the last). Masks of a
    vector and a scalar are one comparison (ko < KO or 0): the interpreter's & of the two is int32."""
    first = p * SPLIT
    hs_ptr = part_ptr + (first * 0 + H * SPLIT).to(tl.int64) * KO      # (a tensor even where H is 1, a constexpr)
    tl.store(part_ptr + (first + part).to(tl.int64) * KO + ko, acc, mask=ko < KO)
    tl.store(hs_ptr + first + part, hrow)
    # split-K's serial fixup: the CTA barrier orders every thread's stores before the release;
    # the acquire (and loads past the L1) make the other parts' visible to the last
    tl.debug_barrier()
    last = tl.atomic_add(tick_ptr + p, 1, sem="acq_rel") == s - 1
    acc = tl.zeros_like(acc)                 # the row's sums restart from its slots
    hrow = tl.zeros_like(hrow)
    for j in tl.static_range(SPLIT):
        use = last & (j < s)
        acc += tl.load(part_ptr + (first + j).to(tl.int64) * KO + ko, mask=ko < tl.where(use, KO, 0), other=0.0,
                       cache_modifier=".cg")
        hrow += tl.load(hs_ptr + first + j, mask=use, other=0.0, cache_modifier=".cg")
    return acc, hrow, last


@triton.jit
def twell_rows_kernel(
    x_ptr, sx_m, sx_k, g_ptr, sg_m,
    list_ptr, cnt_ptr, order_ptr, ctr_ptr,
    wu_ptr, swu_n, swu_k, bu_ptr,
    wdt_ptr, swd_n, swd_k, bd_ptr,
    y_ptr, sy_m, sy_k, hsum_ptr,
    part_ptr, tick_ptr, H,
    M, K, N, KO, W,
    GATED: tl.constexpr, HAS_BU: tl.constexpr, HAS_BD: tl.constexpr,
    K_P: tl.constexpr, KO_P: tl.constexpr, PAIRS: tl.constexpr, CH: tl.constexpr,
    PF: tl.constexpr, STAGES: tl.constexpr, NB: tl.constexpr, ACT: tl.constexpr, PDL: tl.constexpr,
    SPLIT: tl.constexpr, SEG: tl.constexpr,
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    p = pid
    if SPLIT > 1:
        # the first H rows in order (the heaviest) take SPLIT programs each, the others one
        heavy = pid < H * SPLIT
        p = tl.where(heavy, pid // SPLIT, pid - H * (SPLIT - 1))
        part = tl.where(heavy, pid % SPLIT, 0)
    m = row_at(order_ptr, ctr_ptr, p, M, NB)
    ks = tl.arange(0, K_P)
    k_ok = ks < K
    ko = tl.arange(0, KO_P)
    ko_ok = ko < KO
    xr = tl.load(x_ptr + m * sx_m + ks * sx_k, mask=k_ok, other=0.0).to(tl.float32)
    bad = tl.sum(((xr != xr) | (tl.abs(xr) == float("inf"))).to(tl.int32), axis=0) > 0
    cnt = tl.load(cnt_ptr + m)
    nl = tl.where(bad, 0, tl.minimum(cnt, W))
    row0 = m * W
    lrow = row0
    if SPLIT > 1:
        s = nl * 0 + 1
        if heavy:
            # this program's part of the row's list (the exact tail stays with part 0). A row is
            # split only where its whole bucket lies in the first H: the rows split are then the
            # same whatever order the compaction's atomics gave a bucket's rows, and so are y's
            # bits. The other programs branch past this, as past the join below.
            s, lo, nl = _split_range(nl, bucket_end(ctr_ptr, p, NB) <= H, part, SEG, SPLIT)
            lrow += lo
    pa = tl.arange(0, PAIRS)
    acc = tl.zeros((KO_P,), dtype=tl.float32)
    hs = tl.zeros((PAIRS,), dtype=tl.float32)
    wu_m = k_ok[None, :]
    wd_m = ko_ok[None, :]

    # 1. list loop. Prologue: (col, value) of pairs 0..PAIRS-1.
    dt = g_ptr.dtype.element_ty
    live = pa < nl
    n, g = _unpack(tl.load(list_ptr + lrow + pa, mask=live, other=0), dt)
    if PF == 2:
        wu = _wrows(wu_ptr, n, swu_n, ks, swu_k, live, wu_m, g, GATED)
        wd = _wrows(wdt_ptr, n, swd_n, ko, swd_k, live, wd_m, g, True)
        live1 = (PAIRS + pa) < nl
        n1, g1 = _unpack(tl.load(list_ptr + lrow + PAIRS + pa, mask=live1, other=0), dt)
        for p0 in range(0, nl, PAIRS):
            # weight rows of the next pairs, (col, value) of the pairs after, then this step
            wu1 = _wrows(wu_ptr, n1, swu_n, ks, swu_k, live1, wu_m, g1, GATED)
            wd1 = _wrows(wdt_ptr, n1, swd_n, ko, swd_k, live1, wd_m, g1, True)
            p2 = p0 + 2 * PAIRS + pa
            live2 = p2 < nl
            n2, g2 = _unpack(tl.load(list_ptr + lrow + p2, mask=live2, other=0), dt)
            acc, hs = _pair(acc, hs, xr, g, n, live, wu, wd, bu_ptr, k_ok, GATED, HAS_BU, ACT)
            wu, wd, g, n, live = wu1, wd1, g1, n1, live1
            g1, n1, live1 = g2, n2, live2
    elif PF == 3:
        # software-pipelined by Triton: list entries and weight rows of later pairs in flight
        for p0 in tl.range(0, nl, PAIRS, num_stages=STAGES):
            pl = p0 + pa
            lv = pl < nl
            n, g = _unpack(tl.load(list_ptr + lrow + pl, mask=lv, other=0), dt)
            wu = _wrows(wu_ptr, n, swu_n, ks, swu_k, lv, wu_m, g, GATED)
            wd = _wrows(wdt_ptr, n, swd_n, ko, swd_k, lv, wd_m, g, True)
            acc, hs = _pair(acc, hs, xr, g, n, lv, wu, wd, bu_ptr, k_ok, GATED, HAS_BU, ACT)
    else:
        for p0 in range(0, nl, PAIRS):
            wu = _wrows(wu_ptr, n, swu_n, ks, swu_k, live, wu_m, g, GATED)
            wd = _wrows(wdt_ptr, n, swd_n, ko, swd_k, live, wd_m, g, True)
            if PF == 1:   # next (col, value) requested before this step's reductions
                p1 = p0 + PAIRS + pa
                live1 = p1 < nl
                n1, g1 = _unpack(tl.load(list_ptr + lrow + p1, mask=live1, other=0), dt)
                acc, hs = _pair(acc, hs, xr, g, n, live, wu, wd, bu_ptr, k_ok, GATED, HAS_BU, ACT)
                g, n, live = g1, n1, live1
            else:
                acc, hs = _pair(acc, hs, xr, g, n, live, wu, wd, bu_ptr, k_ok, GATED, HAS_BU, ACT)
                p1 = p0 + PAIRS + pa
                live = p1 < nl
                n, g = _unpack(tl.load(list_ptr + lrow + p1, mask=live, other=0), dt)

    # 2. exact tail over g itself: after the W-th listed column (cnt > W), or every column (bad x).
    over = (cnt > W) & (~bad)
    if SPLIT > 1:
        over = over & (part == 0)
    last = (tl.load(list_ptr + row0 + W - 1, mask=over, other=0) >> 16) & 0xFFFF
    start = tl.where(bad, 0, tl.where(over, last + 1, N))
    if SPLIT > 1:
        start = tl.where(part == 0, start, N)
    cc = tl.arange(0, CH)
    for c0 in range(start, N, CH):
        cn = c0 + cc
        c_ok = cn < N
        gv = tl.load(g_ptr + m * sg_m + cn, mask=c_ok, other=0.0)
        v = tl.where(gv < 0.0, 0.0, gv).to(tl.float32)            # relu(g) as rounded by cuBLAS
        act = ((v != 0.0) | bad) & c_ok
        incl, na = scan(act)
        for q in range(0, na, PAIRS):
            sel, tl_live, tn = select(act, incl, na, q, pa, c0, cc)
            tg = pick(sel, v)
            twu = _wrows(wu_ptr, tn, swu_n, ks, swu_k, tl_live, wu_m, tg, GATED)
            twd = _wrows(wdt_ptr, tn, swd_n, ko, swd_k, tl_live, wd_m, tg, True)
            acc, hs = _pair(acc, hs, xr, tg, tn, tl_live, twu, twd, bu_ptr, k_ok, GATED, HAS_BU, ACT)
    hrow = tl.sum(hs, axis=0)
    if SPLIT > 1:
        write = (s == 1) & (part == 0)
        if (s > 1) & (part < s):
            # a split row's parts only: the others skip the join's slot stores, CTA barrier,
            # ticket and slot loads
            acc, hrow, write = _join_parts(acc, hrow, part_ptr, tick_ptr, p, part, s, ko, H, KO, SPLIT)
        ko_ok = ko < tl.where(write, KO, 0)
    if HAS_BD:
        acc += tl.load(bd_ptr + ko, mask=ko_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * sy_m + ko * sy_k, acc.to(y_ptr.dtype.element_ty), mask=ko_ok)
    if SPLIT > 1:
        tl.store(hsum_ptr + m, hrow, mask=write)
    else:
        tl.store(hsum_ptr + m, hrow)
