"""Triton device code: the fused sparse FFN tail, y = down(h) with h = relu(g) [* up(x)].

One program owns one token row m; its y row [K_out] and x row [K] stay in registers, h never
touches global memory. Work items per (row, tile):

  loop 1, pairs: every non-zero of a tile whose values are stored (counts <= SLOTS: the TwELL
     slots; counts > SLOTS: the dense overflow tile, whose j-th non-zero is found with a
     prefix count over the tile). Per pair: u = x . W_u[n] (+ b_u), h = g * u,
     y += h * W_d^T[n]. Cost: two 2*K-byte weight rows from L2 per pair.
  loop 2, recompute: tiles whose overflow did not fit the buffer, and every tile of a row whose
     x holds NaN/Inf (dense semantics: 0 * Inf = NaN must appear), recompute all TILE columns
     exactly: g = relu(x . W_g[n] + b_g) rounded to the dtype, then as above.

Items of a loop are numbered flatly across tiles (a prefix sum over the row's tiles) and taken
PAIRS at a time, so a row costs ceil(pairs / PAIRS) iterations whatever its spread over tiles.
Also writes sum |h| per row (for stats), in fp32.
"""

import triton
import triton.language as tl

from twell_compile.kernels.twell_rows import _pair, _wrows  # the per-pair step both paths share


@triton.jit
def _locate(p, incl, w, ts):
    """Tile index and in-tile item index of flat item numbers p [PAIRS] (prefix sums incl)."""
    t = tl.sum((incl[None, :] <= p[:, None]).to(tl.int32), axis=1)
    sel = ts[None, :] == t[:, None]
    start = tl.sum(tl.where(sel, incl - w, 0), axis=1)
    return t, p - start, sel


@triton.jit
def twell_ffn_kernel(
    x_ptr, sx_m, sx_k,
    vals_ptr, cols_ptr, counts_ptr, oslot_ptr, ovals_ptr,
    wg_ptr, swg_n, swg_k, bg_ptr,
    wu_ptr, swu_n, swu_k, bu_ptr,
    wdt_ptr, swd_n, swd_k, bd_ptr,
    y_ptr, sy_m, sy_k, hsum_ptr,
    K, N, KO, NT,
    GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, HAS_BD: tl.constexpr,
    TILE: tl.constexpr, SLOTS: tl.constexpr, NT_P: tl.constexpr, K_P: tl.constexpr,
    KO_P: tl.constexpr, PAIRS: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, K_P)
    k_ok = ks < K
    ko = tl.arange(0, KO_P)
    ko_ok = ko < KO
    xr = tl.load(x_ptr + m * sx_m + ks * sx_k, mask=k_ok, other=0.0).to(tl.float32)
    bad = tl.sum(((xr != xr) | (tl.abs(xr) == float("inf"))).to(tl.int32), axis=0) > 0

    ts = tl.arange(0, NT_P)
    t_ok = ts < NT
    row = m * NT
    cnt = tl.load(counts_ptr + row + ts, mask=t_ok, other=0)
    over = t_ok & (cnt > SLOTS)
    osl = tl.load(oslot_ptr + row + ts, mask=over, other=-1)
    stored = (~over) | (osl >= 0)
    w1 = tl.where(stored & t_ok & (~bad), cnt, 0)
    w2 = tl.where(t_ok & ((~stored) | bad), TILE, 0)
    incl1 = tl.cumsum(w1, axis=0)
    incl2 = tl.cumsum(w2, axis=0)
    total1 = tl.sum(w1, axis=0)
    total2 = tl.sum(w2, axis=0)

    y = tl.zeros((KO_P,), dtype=tl.float32)
    hs = tl.zeros((PAIRS,), dtype=tl.float32)
    ci = tl.arange(0, TILE)
    for p0 in range(0, total1, PAIRS):
        p = p0 + tl.arange(0, PAIRS)
        live = p < total1
        t, j, sel = _locate(p, incl1, w1, ts)
        c_t = tl.sum(tl.where(sel, cnt, 0), axis=1)
        o_t = tl.sum(tl.where(sel, osl, 0), axis=1)
        in_slots = live & (c_t <= SLOTS)
        in_ovf = live & (c_t > SLOTS)
        sidx = (row + t) * SLOTS + j
        col_s = tl.load(cols_ptr + sidx, mask=in_slots, other=0).to(tl.int32)
        val_s = tl.load(vals_ptr + sidx, mask=in_slots, other=0.0).to(tl.float32)
        # Dense overflow tile: the j-th non-zero (NaN included) of the TILE values.
        ov = tl.load(ovals_ptr + o_t.to(tl.int64)[:, None] * TILE + ci[None, :],
                     mask=in_ovf[:, None], other=0.0).to(tl.float32)
        onz = ov != 0.0
        orank = tl.cumsum(onz.to(tl.int32), axis=1) - 1
        hit = onz & (orank == j[:, None])
        col_o = tl.sum(tl.where(hit, ci[None, :], 0), axis=1)
        val_o = tl.sum(tl.where(hit, ov, 0.0), axis=1)
        col = tl.where(in_ovf, col_o, col_s)
        g = tl.where(in_ovf, val_o, val_s)
        n = (t * TILE + col).to(tl.int64)
        wu = _wrows(wu_ptr, n, swu_n, ks, swu_k, live, k_ok[None, :], g, GATED)
        wd = _wrows(wdt_ptr, n, swd_n, ko, swd_k, live, ko_ok[None, :], g, True)
        y, hs = _pair(y, hs, xr, g, n, live, wu, wd, bu_ptr, k_ok, GATED, HAS_BU)
    for p0 in range(0, total2, PAIRS):
        p = p0 + tl.arange(0, PAIRS)
        t, j, sel = _locate(p, incl2, w2, ts)
        n = (t * TILE + j).to(tl.int64)
        live = (p < total2) & (n < N)
        wg = tl.load(wg_ptr + n[:, None] * swg_n + ks[None, :] * swg_k,
                     mask=live[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        g = tl.sum(wg * xr[None, :], axis=1)
        if HAS_BG:
            g += tl.load(bg_ptr + n, mask=live, other=0.0).to(tl.float32)
        g = tl.where(g < 0.0, 0.0, g).to(vals_ptr.dtype.element_ty).to(tl.float32)
        wu = _wrows(wu_ptr, n, swu_n, ks, swu_k, live, k_ok[None, :], g, GATED)
        wd = _wrows(wdt_ptr, n, swd_n, ko, swd_k, live, ko_ok[None, :], g, True)
        y, hs = _pair(y, hs, xr, g, n, live, wu, wd, bu_ptr, k_ok, GATED, HAS_BU)
    if HAS_BD:
        y += tl.load(bd_ptr + ko, mask=ko_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * sy_m + ko * sy_k, y.to(y_ptr.dtype.element_ty), mask=ko_ok)
    tl.store(hsum_ptr + m, tl.sum(hs, axis=0))
