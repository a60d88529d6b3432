"""Triton device code: the sparse backward's per-neuron passes (after the row kernel's ranks).

``scatter_kernel`` (counting sort, last step): the row kernel counted each column's entries
(hist) and gave each entry its rank in its column (rk); with off = exclusive prefix sum of
hist, entry (m, p) of column n goes to order[off[n] + rk[m, p]] = m * WP + p, 32 bits unsigned
(WP: W to a power of 2), so a pass finds the entry's row and slot with a shift and a mask: a
64-bit m = idx // W was an 84-instruction division routine per entry (sm_90a) on the path from
the order load to the row gather. No host sync: order has the fixed size M * W.

``wgrad_plan_kernel`` (one program, after the ranks): off = the exclusive prefix sum of hist (the
counting sort's column offsets); CHUNK = max(OVER x (entries // N), FLOOR); each neuron's chunk
count max(ceil(hist / CHUNK), 1), their exclusive prefix sum coff and total (the passes' ticket
bound): the scans and the chunk arithmetic in one launch.

``wgrad_kernel``: persistent programs over (chunk of one neuron's entries, chunk of BKW
columns), fp32, in one of two passes (constexpr DY). A neuron's entries are cut into chunks of
at most CHUNK (``chunk_map_kernel`` lists each chunk's neuron), which the programs take in
order from an atomic ticket, so a hot neuron (a trained layer has some) does not hold one
program alone. CHUNK, a device scalar (no host sync), is wg_chunk_over_mean mean
lists, at least wg_chunk: i.i.d. layers at large M do not split every neuron. A neuron of one
chunk adds its sums to the outputs (fp32, the dense backup's part already in) with plain loads
and stores; the chunks of a split neuron add theirs atomically. Each pass gathers rows of one
[M, 2048]-sized tensor only (64 MB at M=16384 bf16: about an H200's L2):

  DY pass (whole rows, BKW >= K_out): W_d^T[n] in registers; per entry the dy row gathered,
      dh = dy[m] . W_d^T[n] (+ l1c sgn(h); l1c times *l1_ptr with L1_DEV), d_g = dh u [h_g > 0], d_u = dh h_g, h = h_g u;
      dW_d^T[n] = sum h dy[m], db_g[n] = sum d_g, db_u[n] = sum d_u; d_g and d_u (fp32)
      written at the entry's slot for the other passes.
  X pass: per entry the x row gathered; dW_g[n] = sum d_g x[m], dW_u[n] = sum d_u x[m].

Rows listed in mlist (busy rows past the dense backup, rows with non-finite x or dy) are
recomputed per neuron in both passes, by the neuron's first chunk: g, u, dh at (m, n) from x,
dy and the weight rows (full dot products; slow, exact, rare). The dense backup rows' part is
already in the outputs (cuBLAS products written there first), so a neuron with no entries
keeps exactly that part.

The [E, BKW] tiles must lie along K inside each warp (BKW >= 256 x warps): the sums over the E
entries then stay in registers (BKW 2048 / E 4 / 4 warps: warpsPerCTA [1, 4]). On the 4-layer
model both passes take 4.30 ms per step (profile_train_step.py; the measurements and the
designs that lost: docs/design-notes/training.md)."""

import triton
import triton.language as tl

from twell_compile.kernels.act import grads, hidden


@triton.jit
def scatter_kernel(cols_ptr, rk_ptr, q_ptr, off_ptr, order_ptr, W, WP: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, WP)
    q = tl.load(q_ptr + m)                       # -1 for busy rows: no entries
    for p0 in range(0, q, WP):
        pp = p0 + p
        live = pp < q
        n = tl.load(cols_ptr + m * W + pp, mask=live, other=0)
        pos = tl.load(off_ptr + n, mask=live, other=0) + tl.load(rk_ptr + m * W + pp, mask=live, other=0)
        tl.store(order_ptr + pos.to(tl.int64), (m * WP + pp).to(tl.uint32).to(tl.int32, bitcast=True), mask=live)


@triton.jit
def wgrad_plan_kernel(hist_ptr, off_ptr, coff_ptr, ctot_ptr, chunk_ptr, N, FLOOR, OVER, B: tl.constexpr):
    b = tl.arange(0, B)
    total = tl.sum(tl.zeros((B,), dtype=tl.int32), axis=0)
    for n0 in range(0, N, B):
        total += tl.sum(tl.load(hist_ptr + n0 + b, mask=n0 + b < N, other=0), axis=0)
    chunk = tl.maximum((total // N) * OVER, FLOOR)
    run = total * 0
    crun = total * 0
    for n0 in range(0, N, B):
        nn = n0 + b
        ok = nn < N
        h = tl.load(hist_ptr + nn, mask=ok, other=0)
        tl.store(off_ptr + nn, run + tl.cumsum(h, axis=0) - h, mask=ok)
        nch = tl.where(ok, tl.maximum((h + chunk - 1) // chunk, 1), 0)
        tl.store(coff_ptr + nn, crun + tl.cumsum(nch, axis=0) - nch, mask=ok)
        run += tl.sum(h, axis=0)
        crun += tl.sum(nch, axis=0)
    tl.store(ctot_ptr, crun)
    tl.store(chunk_ptr, chunk)


@triton.jit
def chunk_map_kernel(coff_ptr, ctot_ptr, nid_ptr, N, BJ: tl.constexpr):
    """nid[coff[n] + j] = n for each chunk j of neuron n: its count is the next neuron's chunk
    offset (ctot after the last) minus its own, as wgrad_plan_kernel laid them out."""
    n = tl.program_id(0)
    start = tl.load(coff_ptr + n)
    last = n + 1 >= N
    end = tl.where(last, tl.load(ctot_ptr), tl.load(coff_ptr + n + 1, mask=n + 1 < N, other=0))
    nch = end - start
    j = tl.arange(0, BJ)
    for j0 in range(0, nch, BJ):
        tl.store(nid_ptr + start + j0 + j, n, mask=j0 + j < nch)


@triton.jit
def _dot(a_ptr, b_ptr, L, BKW: tl.constexpr):
    """sum a[:L] * b[:L] in fp32 (rows of length L)."""
    kb = tl.arange(0, BKW)
    acc = tl.zeros((BKW,), dtype=tl.float32)
    for k0 in range(0, L, BKW):
        kk = k0 + kb
        ok = kk < L
        acc += tl.load(a_ptr + kk, mask=ok, other=0.0).to(tl.float32) * tl.load(b_ptr + kk, mask=ok, other=0.0).to(tl.float32)
    return tl.sum(acc, axis=0)


@triton.jit
def _listed(m, n, x_ptr, sx_m, dy_ptr, sdy_m, wg_ptr, swg_n, bgate_ptr, wu_ptr, swu_n, bup_ptr,
            wdt_ptr, swd_n, l1c, K, KO, dt,
            GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, L1: tl.constexpr,
            BKW: tl.constexpr, ACT: tl.constexpr):
    """(d_g, d_u, h) at (m, n) recomputed from x, dy and the weight rows, fp32 (g, u rounded
    to dt as cuBLAS rounds them)."""
    g = _dot(wg_ptr + n * swg_n, x_ptr + m * sx_m, K, BKW)
    if HAS_BG:
        g += tl.load(bgate_ptr + n).to(tl.float32)
    g = g.to(dt).to(tl.float32)
    hg = tl.where(g < 0.0, 0.0, g)
    if GATED:
        u = _dot(wu_ptr + n * swu_n, x_ptr + m * sx_m, K, BKW)
        if HAS_BU:
            u += tl.load(bup_ptr + n).to(tl.float32)
        u = u.to(dt).to(tl.float32)
    else:
        u = hg
    h = hidden(hg, u, GATED, ACT)
    dh = _dot(wdt_ptr + n * swd_n, dy_ptr + m * sdy_m, KO, BKW)
    if L1:
        dh += l1c * (tl.where(h > 0.0, 1.0, 0.0) - tl.where(h < 0.0, 1.0, 0.0))
    dg, du = grads(dh, hg, u, GATED, ACT)
    return dg, du, h


@triton.jit
def _add_to(ptr, v, mask, atomic):
    """*ptr += v in fp32: atomically where other programs add to the same place (a split
    neuron's chunks), else a plain load and store."""
    if atomic:
        tl.atomic_add(ptr, v, mask=mask, sem="relaxed")
    else:
        tl.store(ptr, tl.load(ptr, mask=mask, other=0.0) + v, mask=mask)


@triton.jit
def wgrad_kernel(
    order_ptr, off_ptr, hist_ptr, nid_ptr, coff_ptr, ctot_ptr, ticket_ptr, chunk_ptr, W,
    ellg_ptr, ellu_ptr, eg_ptr, eu_ptr, x_ptr, sx_m, dy_ptr, sdy_m,
    mlist_ptr, mctr_ptr, wg_ptr, swg_n, bgate_ptr, wu_ptr, swu_n, bup_ptr, wdt_ptr, swd_n, l1c, l1_ptr,
    dwg_ptr, dwu_ptr, dwd_ptr, dbg_ptr, dbu_ptr,   # fp32 [N, K], [N, K], [N, KO] (backup part in), [N], [N]
    K, KO,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, L1: tl.constexpr, L1_DEV: tl.constexpr,
    DY: tl.constexpr, BKW: tl.constexpr, E: tl.constexpr, ACT: tl.constexpr, WP: tl.constexpr,
):
    if L1_DEV:                                      # the controller's coefficient (fp32 [1])
        l1c = l1c * tl.load(l1_ptr)
    jk = tl.program_id(1)
    ks = jk * BKW + tl.arange(0, BKW)
    ok = ks < (KO if DY else K)
    dt = x_ptr.dtype.element_ty
    ea = tl.arange(0, E)
    nlisted = tl.load(mctr_ptr)
    total = tl.load(ctot_ptr)
    CHUNK = tl.load(chunk_ptr)
    ticket = ticket_ptr + jk                        # chunks taken in order, one counter per column chunk
    t = tl.atomic_add(ticket, 1, sem="relaxed")
    while t < total:
        nxt = tl.atomic_add(ticket, 1, sem="relaxed")   # the next chunk's ticket, ahead of this one's work
        n = tl.load(nid_ptr + t).to(tl.int64)
        j = t - tl.load(coff_ptr + n)
        c_all = tl.load(hist_ptr + n)
        split = c_all > CHUNK
        c = tl.minimum(c_all - j * CHUNK, CHUNK)
        start = tl.load(off_ptr + n).to(tl.int64) + j * CHUNK
        acc1 = tl.zeros((BKW,), dtype=tl.float32)      # DY: dW_d^T[n]; X: dW_g[n]
        acc2 = tl.zeros((BKW,), dtype=tl.float32)      # X: dW_u[n]
        sg = tl.zeros((E,), dtype=tl.float32)
        su = tl.zeros((E,), dtype=tl.float32)
        if DY:
            wd = tl.load(wdt_ptr + n * swd_n + ks, mask=ok, other=0.0).to(tl.float32)
        for e0 in range(0, c, E):
            e = e0 + ea
            live = e < c
            code = tl.load(order_ptr + start + e, mask=live, other=0).to(tl.uint32, bitcast=True)
            row = code // WP                                # WP a power of 2: a shift
            idx = (row * W + code % WP).to(tl.int64)        # the entry's slot in [M, W] (< 2^31)
            m = row.to(tl.int64)
            if DY:
                dyt = tl.load(dy_ptr + m[:, None] * sdy_m + ks[None, :], mask=live[:, None] & ok[None, :], other=0.0).to(tl.float32)
                dh = tl.sum(dyt * wd[None, :], axis=1)
                hg = tl.load(ellg_ptr + idx, mask=live, other=0.0).to(tl.float32)
                u = tl.load(ellu_ptr + idx, mask=live, other=0.0).to(tl.float32) if GATED else hg
                h = hidden(hg, u, GATED, ACT)
                if L1:
                    dh += l1c * (tl.where(h > 0.0, 1.0, 0.0) - tl.where(h < 0.0, 1.0, 0.0))
                dg, du = grads(dh, hg, u, GATED, ACT)                     # NaN passes, as threshold_backward
                dg = tl.where(live, dg, 0.0)
                du = tl.where(live, du, 0.0)
                tl.store(eg_ptr + idx, dg, mask=live)
                if GATED:
                    tl.store(eu_ptr + idx, du, mask=live)
                hq = tl.where(live, h.to(dt).to(tl.float32), 0.0)       # h as eager rounds it
                acc1 += tl.sum(hq[:, None] * dyt, axis=0)
                sg += dg
                su += du
            else:
                xt = tl.load(x_ptr + m[:, None] * sx_m + ks[None, :], mask=live[:, None] & ok[None, :], other=0.0).to(tl.float32)
                dg = tl.load(eg_ptr + idx, mask=live, other=0.0)
                acc1 += tl.sum(dg[:, None] * xt, axis=0)
                if GATED:
                    du = tl.load(eu_ptr + idx, mask=live, other=0.0)
                    acc2 += tl.sum(du[:, None] * xt, axis=0)
        # rows listed by the row kernel (the neuron's first chunk): recompute g, u, dh at (m, n)
        for i in range(0, tl.where(j == 0, nlisted, 0)):
            m = tl.load(mlist_ptr + i).to(tl.int64)
            dgm, dum, h = _listed(m, n, x_ptr, sx_m, dy_ptr, sdy_m, wg_ptr, swg_n, bgate_ptr, wu_ptr, swu_n,
                                  bup_ptr, wdt_ptr, swd_n, l1c, K, KO, dt, GATED, HAS_BG, HAS_BU, L1, BKW, ACT)
            if DY:
                acc1 += h.to(dt).to(tl.float32) * tl.load(dy_ptr + m * sdy_m + ks, mask=ok, other=0.0).to(tl.float32)
                sg += tl.where(ea == 0, dgm, 0.0)
                su += tl.where(ea == 0, dum, 0.0)
            else:
                xm = tl.load(x_ptr + m * sx_m + ks, mask=ok, other=0.0).to(tl.float32)
                acc1 += dgm * xm
                acc2 += dum * xm
        if DY:
            _add_to(dwd_ptr + n * KO + ks, acc1, ok, split)
            if HAS_BG:
                _add_to(dbg_ptr + n, tl.sum(sg, axis=0), n >= 0, split)
            if HAS_BU:
                _add_to(dbu_ptr + n, tl.sum(su, axis=0), n >= 0, split)
        else:
            _add_to(dwg_ptr + n * K + ks, acc1, ok, split)
            if GATED:
                _add_to(dwu_ptr + n * K + ks, acc2, ok, split)
        t = nxt
