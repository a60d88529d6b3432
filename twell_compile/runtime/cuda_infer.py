"""CUDA inference launchers: the per-row TwELL path, the dense path, and the plan's runner.

TwELL path (``twell_forward``), for x [M, K] (bf16/fp16), three launches:
  1. the gate GEMM g = x W_g^T + b_g: cuBLAS (F.linear), or, where the record names one
     (gate_cfg), twell::gate_pack (runtime/cuda_gate.py), which also packs each row's non-zeros
     per tile of columns in its epilogue.
  2. ``compact_rows_kernel`` (kernels/twell_rows.py): one read of g; per row the count of
     relu(g)'s non-zeros and its first W (value, column) pairs, contiguous. After
     twell::gate_pack, ``merge_tiles_kernel`` makes the same from the packed tiles instead.
  3. ``twell_rows_kernel``: per token, up projection for the listed pairs only, times g, down
     projection, y written once. Rows with count > W continue over g after the W-th listed
     column; rows whose x holds NaN/Inf take every column. Exact, nothing dropped.
The Triton launches of the path use programmatic dependent launch on Hopper (launch.pdl_ok).
Dense path (``dense_forward``): eager's GEMMs, bit-identical to eager, with one Triton pass for
relu (* up) that also counts non-zeros per row; at decode sizes optionally replayed from the
op's own CUDA graph. Decode path: runtime/cuda_decode.py. No host sync: capacities are fixed,
overflow is decided on the device. Launch sizes come from the device's record (arch.py).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from twell_compile import stats
from twell_compile.kernels.relu_mul import relu_mul_rows_kernel
from twell_compile.kernels.row_stats import row_stats_kernel
from twell_compile.kernels.twell_rows import compact_rows_kernel, merge_tiles_kernel, twell_rows_kernel
from twell_compile.reference import ACTS, activate
from twell_compile.runtime import arch, cuda_decode, cuda_gate, decode_graphs, density
from twell_compile.runtime.launch import INTERPRET, launch, pdl_ok, pow2, transposed, unit_rows, warps_by_width
from twell_compile.runtime.paths import MAX_N
from twell_compile.runtime.select import InferPlan

TAIL_CH = 256         # columns per step of the exact tail over g
TRANSPOSE_TILE = 64   # W_down^T's tiles in the compaction's launch (as launch.transposed's)


class Rows(NamedTuple):
    """Gate output of the per-row path."""
    g: Tensor        # [M, N] pre-activation (cuBLAS), read again only by the exact tail
    lst: Tensor      # [M, W] int32: first W non-zeros of relu(g) per row, (col << 16) | bits
    cnt: Tensor      # [M] int32 non-zeros per row (may exceed W); slots >= cnt unwritten
    order: Tensor    # [NB * M] int32: the rows by bucket, heaviest first (cnt > W in bucket 0)
    ctr: Tensor      # [NB] int32 rows per bucket
    tick: Tensor     # [H] int32 zeroed: the row kernel's counters for the first H rows in order,
                     # which it splits (the record's row_split; empty: no split)

    def rows_in_order(self) -> Tensor:
        """The row kernels' order as one permutation [M] (tests; syncs)."""
        m = self.cnt.numel()
        return torch.cat([self.order[b * m: b * m + int(c)] for b, c in enumerate(self.ctr.tolist())])

    @property
    def cols(self) -> Tensor:
        return (self.lst >> 16) & 0xFFFF

    @property
    def vals(self) -> Tensor:
        return (self.lst & 0xFFFF).to(torch.int16).view(self.g.dtype)


def _transpose_programs(transpose: Optional[tuple[Tensor, Tensor]], g: Tensor, nc: int
                        ) -> tuple[int, tuple, dict]:
    """What a compaction or merge launch of ``nc`` programs adds to write out = w^T for
    ``transpose`` (w, out): its TRANSPOSE_TILE-square tiles as programs after the launch's own
    (kernels/transpose.transpose_tile_at), as (their count, the kernel's trailing arguments, its
    constexprs). None: no programs, g standing in for the unread pointers."""
    w, wt = transpose if transpose is not None else (g, g)
    tiles = -(-w.shape[0] // TRANSPOSE_TILE) * -(-w.shape[1] // TRANSPOSE_TILE) if transpose is not None else 0
    return (tiles, (w, wt, w.shape[0], w.shape[1], w.stride(0), w.stride(1), nc),
            dict(TRANSPOSE=transpose is not None, TB=TRANSPOSE_TILE))


def gate_rows(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], width: int,
              transpose: Optional[tuple[Tensor, Tensor]] = None, split: bool = False) -> Rows:
    """g = x2 W_g^T + b_g and its per-row lists: by twell::gate_pack, which packs them in its
    epilogue, then merge_rows, where the record names a configuration (gate_cfg) for this many
    tokens (gate_min_m) and the call can run it (cuda_gate.runs); else by cuBLAS, then one
    compaction pass over g. ``transpose`` (w, out): out = w^T is written too, by the compaction's
    (or the merge's) launch where the record says so (compact_transpose), else by a launch of
    its own. ``split``: the row kernel may split the heaviest rows the record's row_split names
    (select.splits_rows: the plan's choice)."""
    p = arch.launch_policy(x2.device)
    if transpose is not None and not p.compact_transpose:
        transposed(*transpose)
        transpose = None
    split = p.split_rows(x2.shape[0]) if split else 0
    if p.gate_cfg >= 0 and x2.shape[0] >= p.gate_min_m and cuda_gate.runs(x2, w_gate, b_gate):
        g, packed, tcnt = cuda_gate.gate_pack(x2, w_gate, b_gate, p.gate_cfg, p.gate_slots, p.gate_raster,
                                              p.gate_swizzle, g="spills")
        return merge_rows(g, packed, tcnt, width, p.row_buckets, tile_n=cuda_gate.CONFIGS[p.gate_cfg].tile_n,
                          transpose=transpose, split_rows=split)
    return compact_rows(F.linear(x2, w_gate, b_gate), width, buckets=p.row_buckets, transpose=transpose,
                        split_rows=split)


def merge_rows(g: Tensor, packed: Tensor, tcnt: Tensor, width: int, buckets: int = 2,
               tile_n: Optional[int] = None, transpose: Optional[tuple[Tensor, Tensor]] = None,
               split_rows: int = 0) -> Rows:
    """The Rows compact_rows would make from g, from twell::gate_pack's packed tiles
    (merge_tiles_kernel): the same lists, counts and bucket order, g read only by a block
    holding a tile over its slots. ``tile_n``: g was written only where the packing spilled
    (gate_pack g="spills"), in tiles of tile_n columns; the rows that read g later (a block
    with a tile over its slots, rows over ``width``: the row kernel's exact tail) get their
    other tiles rebuilt from the slots first (relu-exact: zeros where no slot), so Rows.g
    serves every reader as a whole g would. ``transpose`` (w, out): out = w^T written by the
    same launch, as compact_rows does; ``split_rows``: as compact_rows'."""
    p = arch.launch_policy(g.device)
    m, n = g.shape
    t, s = packed.shape[1], packed.shape[2]
    r = _empty_rows(g, width, buckets, split_rows=split_rows)
    lst, cnt, order, ctr = r.lst, r.cnt, r.order, r.ctr
    if transpose is not None and not m:
        transposed(transpose[0], transpose[1])
    elif m:
        nc = -(-m // p.merge_bm)
        tiles, targs, tconsts = _transpose_programs(transpose, g, nc)
        pdl = pdl_ok(g.device)
        launch(merge_tiles_kernel, (nc + tiles,),
               (packed, tcnt, g, g.stride(0), lst, cnt, order, ctr, m, n, width, t, tile_n or 1, *targs),
               dict(S=s, S_P=pow2(s), T_P=pow2(t), CT=min(max(p.compact_ch // pow2(s), 1), pow2(t)),
                    BM=p.merge_bm, REBUILD=tile_n is not None, CH=min(p.compact_ch, pow2(n)), NB=buckets,
                    STAGES=p.compact_stages, ASM=not INTERPRET, PDL=pdl, **tconsts),
               num_warps=p.compact_warps, pdl=pdl)
    return r


def _empty_rows(g: Tensor, width: int, buckets: int, ctr: Optional[Tensor] = None, split_rows: int = 0) -> Rows:
    """Rows' outputs for g [M, N], unwritten; the order's ``buckets`` counters and the row
    kernel's ``split_rows`` ones zeroed, by one memset (``ctr`` when given: no split)."""
    m = g.shape[0]
    i32 = dict(dtype=torch.int32, device=g.device)
    if ctr is None:
        zeros = torch.zeros((buckets + split_rows,), **i32)
        ctr, tick = zeros[:buckets], zeros[buckets:]
    else:
        tick = ctr[:0]
    return Rows(g, torch.empty((m, width), **i32), torch.empty((m,), **i32), torch.empty((buckets * m,), **i32),
                ctr, tick)


def compact_rows(g: Tensor, width: int, ctr: Optional[Tensor] = None, buckets: int = 2,
                 transpose: Optional[tuple[Tensor, Tensor]] = None, split_rows: int = 0) -> Rows:
    """The per-row lists of relu(g) for g [M, N] (unit column stride; any row stride), and the
    rows' order in ``buckets`` buckets by cost. ``ctr``: the order's counters, ``buckets``
    zeroed int32 (a caller that zeroes other counters with them saves a memset); allocated
    here when None. Inference and training both compact through this. ``transpose`` (w [R, C],
    out [C, R] contiguous): the same launch also writes out = w^T, 64 x 64 tiles in programs
    after the compaction's (the rows' pass and the copy overlap). ``split_rows``: the first this
    many rows in order are the row kernel's to split (GpuPolicy.split_rows; Rows.tick)."""
    p = arch.launch_policy(g.device)
    m, n = g.shape
    r = _empty_rows(g, width, buckets, ctr, split_rows)
    lst, cnt, order, ctr = r.lst, r.cnt, r.order, r.ctr
    if transpose is not None and not m:
        transposed(transpose[0], transpose[1])
    elif m:
        bm = p.compact_rows_per_program(m)
        nc = -(-m // bm)
        tiles, targs, tconsts = _transpose_programs(transpose, g, nc)
        pdl = pdl_ok(g.device)
        launch(compact_rows_kernel, (nc + tiles,), (g, g.stride(0), lst, cnt, order, ctr, m, n, width, *targs),
               dict(BM=bm, CH=min(p.compact_ch, pow2(n)), NB=buckets, STAGES=p.compact_stages, ASM=not INTERPRET,
                    PDL=pdl, **tconsts),
               num_warps=p.compact_warps, pdl=pdl)
    return r


def fused_rows(x2: Tensor, r: Rows, w_up: Optional[Tensor], b_up: Optional[Tensor],
               w_down: Tensor, b_down: Optional[Tensor], act: str = "relu",
               wdt: Optional[Tensor] = None, out: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(y [M, K_out], sum |h| per row [M] fp32) from the per-row lists (of relu(g); ``act``
    forms h from them). ``wdt``: W_down^T contiguous, written by this call's earlier launches;
    None: transposed here. ``out``: y's storage, [M, K_out] of x2's dtype (else allocated).
    The first ``r.tick.numel()`` rows in order take the record's row_split programs each (their
    parts' fp32 sums in a scratch buffer of as many rows)."""
    p = arch.launch_policy(x2.device)
    m, k = x2.shape
    n, k_out = r.g.shape[1], w_down.shape[0]
    if wdt is None:
        wdt = transposed(w_down)   # per call: ~15 us of ~1 ms, never stale
    wu = w_up if w_up is not None else wdt
    y = torch.empty((m, k_out), dtype=x2.dtype, device=x2.device) if out is None else out
    hsum = torch.empty((m,), dtype=torch.float32, device=x2.device)
    if m == 0:
        return y, hsum
    pdl = pdl_ok(x2.device)
    heavy = min(r.tick.numel(), m)          # rows the plan lets it split (gate_rows: none unless row_split > 1)
    split = p.row_split if heavy else 1
    # the split rows' fp32 sums: [H * split, K_out] for y's rows, then [H * split] for sum |h|
    parts = torch.empty((heavy * split * (k_out + 1),), dtype=torch.float32, device=x2.device) if heavy else hsum
    launch(twell_rows_kernel, (m + heavy * (split - 1),),
           (x2, x2.stride(0), x2.stride(1), r.g, r.g.stride(0), r.lst, r.cnt, r.order, r.ctr,
            wu, wu.stride(0), wu.stride(1), b_up if b_up is not None else x2,
            wdt, wdt.stride(0), wdt.stride(1), b_down if b_down is not None else x2,
            y, y.stride(0), y.stride(1), hsum, parts, r.tick if heavy else r.cnt, heavy,
            m, k, n, k_out, r.lst.shape[1]),
           dict(GATED=w_up is not None, HAS_BU=b_up is not None, HAS_BD=b_down is not None,
                K_P=pow2(k), KO_P=pow2(k_out), PAIRS=p.row_pairs, CH=min(TAIL_CH, pow2(n)), PF=p.row_prefetch,
                STAGES=p.row_stages, NB=r.ctr.numel(), ACT=ACTS.index(act), PDL=pdl,
                SPLIT=split, SEG=max(1, p.row_split_pairs) if heavy else 0),
           num_warps=warps_by_width(max(k, k_out), p.row_cols_per_warp), pdl=pdl)
    return y, hsum


def twell_forward(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                  b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor], width: int,
                  act: str = "relu", out: Optional[Tensor] = None, split: bool = False
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """(y [M, K_out], non-zeros of relu(g) per row [M] int32, sum|h| per row [M] fp32). x2 is
    [M, K]; ``width``: the per-row list width W (select.list_width); ``out``: y's storage
    (fused_rows); ``split``: gate_rows'."""
    n = w_gate.shape[0]
    if n > MAX_N:
        raise ValueError(f"per-row TwELL path packs columns in 16 bits: N={n} > {MAX_N}")
    w_up = None if w_up is None else unit_rows(w_up)
    # W_down^T, made per call (never stale; none where W_down is stored transposed), by the
    # compaction's launch where the record says so
    wdt = w_down.t()
    pending = None
    if not wdt.is_contiguous():
        wdt = torch.empty(wdt.shape, dtype=w_down.dtype, device=w_down.device)
        pending = (w_down, wdt)
    r = gate_rows(x2, w_gate, b_gate, width, transpose=pending, split=split)
    y, hsum = fused_rows(x2, r, w_up, b_up, w_down, b_down, act, wdt, out)
    return y, r.cnt, hsum


def dense_forward(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                  b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor], counts: bool = True,
                  act: str = "relu", out: Optional[Tensor] = None
                  ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Eager's GEMMs, bit-identical to eager. Returns (y, non-zeros of relu(g) per row [M] int32
    (NaN counted), sum of |h| per row [M] fp32).

    relu (* up) is one Triton pass (relu_mul_rows_kernel) that also takes the counts and sums
    the statistics and the density probe need: no extra pass over [M, N] for them. Without
    ``counts`` (no statistics, no probe) and up to the record's eager_elementwise_max_m rows,
    eager's own relu and mul run instead (no counts returned): two aten calls cost less host
    time than the Triton launch's bookkeeping, and the extra pass over [M, N] is small there.
    ``out``: y [M, K_out] written there (the down GEMM's own output: addmm / mm, F.linear's calls).
    """
    g = F.linear(x2, w_gate, b_gate)
    if not counts and x2.shape[0] <= arch.launch_policy(x2.device).eager_elementwise_max_m:
        h = activate(torch.relu(g), None if w_up is None else F.linear(x2, w_up, b_up), act)
        return _linear(h, w_down, b_down, out), None, None
    h, cnt, asum = relu_mul_rows(g, None if w_up is None else F.linear(x2, w_up, b_up), act)
    return _linear(h, w_down, b_down, out), cnt, asum


def _linear(h: Tensor, w: Tensor, b: Optional[Tensor], out: Optional[Tensor]) -> Tensor:
    """F.linear(h, w, b) for 2-D h, into ``out`` where given (the same addmm / mm it calls)."""
    if out is None:
        return F.linear(h, w, b)
    return torch.mm(h, w.t(), out=out) if b is None else torch.addmm(b, h, w.t(), out=out)


def twell_graphed(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                  b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor], width: int,
                  buf: Optional[Tensor], probe: bool, act: str, policy: arch.GpuPolicy, split: bool = False
                  ) -> tuple[Tensor, Optional[Tensor]]:
    """The per-row path replayed from the op's own CUDA graph, where the calls' host time
    exceeds their GPU time (select.rows_host_bound); statistics and result as ``_graphed``'s.
    ``policy``: the record of x2's device (the plan's), whose launch sizes the key holds;
    ``split``: twell_forward's (a graph of its own)."""
    weights = (w_gate, b_gate, w_up, b_up, w_down, b_down)
    return _graphed(("rows", width, act, split, policy.launch_key), x2, weights, buf, probe, width,
                    lambda xs, ys, totals: twell_forward(xs, *weights, width, act, ys, split))


def dense_graphed(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                  b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor], buf: Optional[Tensor] = None,
                  probe: bool = False, act: str = "relu") -> tuple[Tensor, Optional[Tensor]]:
    """dense_forward replayed from the op's own CUDA graph, where eager's calls cost more host
    time than the GEMMs' GPU time (select.dense_host_bound: decode sizes); statistics and
    result as ``_graphed``'s (no counting pass without them)."""
    weights = (w_gate, b_gate, w_up, b_up, w_down, b_down)
    return _graphed(("dense", act, arch.launch_policy(x2.device).launch_key), x2, weights, buf, probe, 0,
                    lambda xs, ys, totals: dense_forward(xs, *weights, counts=totals, act=act, out=ys))


def _graphed(kind: tuple, x2: Tensor, weights: tuple, buf: Optional[Tensor], probe: bool, width: int,
             forward: Callable[[Tensor, Optional[Tensor], bool], tuple[Tensor, Optional[Tensor], Tensor]]
             ) -> tuple[Tensor, Optional[Tensor]]:
    """``forward(x, y_or_None, totals)`` -> (y, per-row counts, per-row |h| sums), replayed from
    the op's own graph under a key of ``kind`` (what the launches bake in besides shapes and
    weights). Statistics go into ``buf`` (the layer's buffer), or, for a ``probe`` without one,
    into a scratch buffer of the graph's; neither: none taken. Returns (y, the statistics
    buffer's first two fields, non-zeros summed over the call and the most of one row, as a view
    the next replay overwrites, or None without statistics)."""
    totals = buf is not None or probe
    key = ((kind, x2.shape, x2.dtype, x2.device, totals, decode_graphs.math_mode(),
            None if buf is None else buf.data_ptr()) + decode_graphs.weights_key(*weights))

    def run(xs: Tensor, ys: Optional[Tensor]) -> tuple[Tensor, ...]:
        y, cnt, hsum = forward(xs, ys, totals)
        if not totals:
            return (y,)
        out = buf if buf is not None else stats.scratch_buffer(xs.device)
        return y, record_stats(None, cnt, hsum, weights[0].shape[0], width, buf=out)[:2]

    # y allocated here: where the allocator hands back the previous call's block, the graph
    # writes y in place (decode_graphs.run's ``out``) and no clone of the graph's y follows
    y = torch.empty((x2.shape[0], weights[4].shape[0]), dtype=x2.dtype, device=x2.device)
    out = decode_graphs.run(key, x2, run, bind=True, out=y)
    return out[0], (out[1] if totals else None)


def relu_mul_rows(g: Tensor, u: Optional[Tensor], act: str = "relu") -> tuple[Tensor, Tensor, Tensor]:
    """(relu(g) * u, or relu(g) when u is None, or the activation ``act``'s h; relu(g)'s
    non-zero count per row [M] int32; sum |h| per row [M] fp32) for 2-D g, u.

    One program per (row, span of columns); a row is split into spans while there are fewer
    than the record's dense_programs rows, and the spans' counts and sums are then added
    atomically into zeroed buffers (one memset).
    """
    p = arch.launch_policy(g.device)
    m, n = g.shape
    if g.stride(-1) != 1:
        g = g.contiguous()
    if u is not None and u.stride(-1) != 1:
        u = u.contiguous()
    h = torch.empty((m, n), dtype=g.dtype, device=g.device)
    block = min(p.dense_block, pow2(n)) if n else 1
    steps = -(-n // block)
    split = max(1, min(steps, -(-p.dense_programs // max(m, 1))))
    span = -(-steps // split) * block
    split = -(-n // span) if n else 1
    # counts and sums share one int32 buffer (zero bits are 0.0f): one memset when split > 1
    buf = (torch.zeros if split > 1 or not n else torch.empty)((2, m), dtype=torch.int32, device=g.device)
    cnt, asum = buf[0], buf[1].view(torch.float32)
    if m and n:
        uu = u if u is not None else g
        launch(relu_mul_rows_kernel, (m, split),
               (g, uu, h, cnt, asum, n, span, g.stride(0), uu.stride(0), h.stride(0)),
               dict(GATED=u is not None, ATOMIC=split > 1, BLOCK=block, ACT=ACTS.index(act)), num_warps=p.dense_warps)
    return h, cnt, asum


def record_stats(layer: Optional[str], cnt: Tensor, hsum: Tensor, n: int, width: int = 0,
                 lost: Optional[Tensor] = None, buf: Optional[Tensor] = None) -> Tensor:
    """The layer's statistics buffer (stats.py) filled from per-row counts [M] int32 and |h|
    sums [M] fp32 in one launch, for every CUDA path but decode (whose kernel writes it). The
    overflows: ``lost`` (a 0-d int32 on the device: training's rows past the dense backup)
    where given, else the rows with count > ``width`` (inference), none when width is 0.
    Returns the buffer: its first field is the summed count, which the density probe reads.
    ``layer`` None: a scratch buffer, no layer's (kernel warm-ups); ``buf``: write this buffer
    (the caller took the layer's, or made a scratch one, itself)."""
    m = cnt.numel()
    if buf is None:
        buf = stats.device_buffer(layer, cnt.device, m, n) if layer is not None else stats.scratch_buffer(cnt.device)
    if m == 0:
        buf.zero_()
    else:
        # one program; a wide block keeps its loads in flight: 4.2 us at M=16384 against 28.7 with
        # 1024-wide steps (H100, profile_product.py --M 16384 --density 0.02)
        block = min(8192, max(128, pow2(m)))
        mode = 2 if lost is not None else 1 if width > 0 else 0
        pdl = pdl_ok(cnt.device)
        launch(row_stats_kernel, (1,), (cnt, hsum, cnt if lost is None else lost, buf, m, width),
               dict(BLOCK=block, OVERFLOW=mode, PDL=pdl), num_warps=max(1, min(16, block // 512)), pdl=pdl)
    return buf


def _eager_stats(layer: str, keep_stats: bool, probe: bool, cnt: Optional[Tensor], hsum: Optional[Tensor],
                 n: int, width: int = 0) -> Optional[Tensor]:
    """An eager call's statistics, written into the layer's buffer where kept, else into a
    scratch one for a probe (one launch either way): the buffer's (summed count, a row's peak)
    fields, which the probe submits; None where neither is wanted."""
    if not (keep_stats or probe):
        return None
    return record_stats(layer if keep_stats else None, cnt, hsum, n, width)[:2]


def ffn_infer(plan: InferPlan, x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
              b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor], layer: str,
              keep_stats: bool, act: str = "relu") -> Tensor:
    """Runs a CUDA inference plan (path "dense", "decode" or "twell"; select.plan_infer) of the
    activation ``act``."""
    k = x.shape[-1]
    flat = x.dim() == 2                   # a 2-D x and its y need no reshape: two aten calls fewer
    x2 = x if flat else x.reshape(-1, k)
    m, n, k_out = x2.shape[0], w_gate.shape[0], w_down.shape[0]
    if plan.path == "decode":
        # the kernel fills the layer's statistics buffer itself: no extra launches
        sbuf = stats.device_buffer(layer, x.device, m, n) if keep_stats else None
        y, tok, hsum = cuda_decode.decode_forward(x2, w_gate, b_gate, w_up, b_up, w_down, b_down,
                                                  stats_buf=sbuf, form=plan.form, graphed=True, act=act)
        if plan.probe:
            density.submit(plan.key, tok[m], m * n)
    elif plan.path == "twell" and plan.graphed and decode_graphs.usable(x2):
        sbuf = stats.device_buffer(layer, x.device, m, n) if keep_stats else None
        y, total = twell_graphed(x2, w_gate, b_gate, w_up, b_up, w_down, b_down, plan.width, sbuf, plan.probe, act,
                                 plan.policy, plan.split)
        if plan.probe:
            density.submit(plan.key, total, m * n)
    elif plan.path == "twell":
        y, per_token, hsum = twell_forward(x2, w_gate, b_gate, w_up, b_up, w_down, b_down, plan.width, act,
                                           split=plan.split)
        total = _eager_stats(layer, keep_stats, plan.probe, per_token, hsum, n, plan.width)
        if plan.probe:
            density.submit(plan.key, total, m * n)
    elif plan.graphed and decode_graphs.usable(x2):
        sbuf = stats.device_buffer(layer, x.device, m, n) if keep_stats else None
        y, total = dense_graphed(x2, w_gate, b_gate, w_up, b_up, w_down, b_down, sbuf, plan.probe, act)
        if plan.probe:
            density.submit(plan.key, total, m * n)
    else:
        y, per_token, hsum = dense_forward(x2, w_gate, b_gate, w_up, b_up, w_down, b_down,
                                           counts=keep_stats or plan.probe, act=act)
        total = _eager_stats(layer, keep_stats, plan.probe, per_token, hsum, n)
        if plan.probe:
            density.submit(plan.key, total, m * n)
    return y if flat else y.reshape(*x.shape[:-1], k_out)
