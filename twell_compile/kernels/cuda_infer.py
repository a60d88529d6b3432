"""CUDA inference FFN: dense (eager's own calls) or TwELL, chosen per call by ``cuda_policy``
from shapes plus a lagged, sync-free per-layer density measurement.

TwELL path (``twell_forward``), for x [M, K] (bf16/fp16), three launches:
  1. cuBLAS gate GEMM g = x W_g^T + b_g (F.linear; 0.52 ms at M=16384, K=2048, N=5632 on H200,
     vs 0.72 ms for the Triton GEMM of ``twell_gate.py``).
  2. ``compact_rows_kernel`` (twell_rows.py): one read of g; per row the count of relu(g)'s
     non-zeros and its first W (value, column) pairs, contiguous.
  3. ``twell_rows_kernel``: per token, up projection for the listed pairs only, times g, down
     projection, y written once. Rows with count > W continue over g after the W-th listed
     column; rows whose x holds NaN/Inf take every column. Exact, nothing dropped.
Decode path (M <= cuda_policy.DECODE_MAX_M tokens): ``cuda_decode.decode_forward``, gate GEMV
over all of W_gate, up/down rows of the union of active neurons only (W_down^T rows read
through the transposed view of W_down: no copy).
The tile path of issue 3's first design (``twell_forward_tiles``: Triton gate GEMM with the
TwELL epilogue + ``twell_fused.py``) stays for comparison (docs/inference.md has both timings).
No host sync on either path: capacities are fixed, overflow is decided on the device, and the
policy only polls CUDA events.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from twell_compile import stats
from twell_compile.kernels import cuda_policy, decode_graphs
from twell_compile.kernels.launch import launch

OVF_DIV = 16          # overflow buffer: one dense tile per 16 (row, tile) pairs
GATE_BLOCK_M = 128
GATE_BLOCK_K = 64
GATE_WARPS = 8
GATE_STAGES = 4
GATE_EPI = 2          # < 2 only to time parts of the epilogue (results then incomplete)
PAIRS = 4             # active pairs per fused-kernel iteration
FUSED_WARPS = 0       # 0: 8 warps for K >= 2048, else 4
# per-row path (twell_rows.py)
COMPACT_BM = 16       # rows per compaction program (H200 M=16384: BM 8/16 0.088/0.074 ms)
COMPACT_CH = 256      # columns per step: 32 lanes x 8, one warp per row (scan in shuffles)
COMPACT_WARPS = 4
# listed pairs per fused iteration, and columns of max(K, K_out) per warp (warps =
# pow2(max(K, K_out)) / ROW_COLS_PER_WARP, at least 1): H200 M=16384 K=2048 d=0.005, session
# 15 run 3 (probe_rows.py): 1 pair / 2 warps 493 us, 4 / 4 531, 2 / 4 595, 4 / 2 617
ROW_PAIRS = 1
ROW_PF = 1            # 0 none, 1: next (col, value) one step ahead, 2: next weight rows too
                      # (H200 M=16384 d=0.005: PF 0/1/2 at 8 warps 0.715/0.736/1.219 ms)
ROW_COLS_PER_WARP = 1024
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"   # no inline PTX there
TAIL_CH = 256         # columns per step of the exact tail over g
MIN_WIDTH = 32
MAX_LIST = 1024

def _transposed(w: Tensor) -> Tensor:
    """w.t() contiguous, recomputed per call by ``transpose.transpose_kernel`` (PyTorch's own
    strided copy took 77 us at [2048, 5632] bf16 on the H200).

    Made per call, never cached: a copy kept across calls goes stale when a weight changes
    without a version bump (``.data``); in a CUDA graph the transpose is replayed too.
    """
    from twell_compile.kernels.transpose import transpose_kernel

    wt = w.t()
    if wt.is_contiguous():
        return wt
    r, c = w.shape
    out = torch.empty((c, r), dtype=w.dtype, device=w.device)
    if w.numel():
        transpose_kernel[(-(-r // 64), -(-c // 64))](w, out, r, c, w.stride(0), w.stride(1),
                                                     BR=64, BC=64, num_warps=4)
    return out


def _rows(w: Tensor) -> Tensor:
    """A weight whose rows are gathered must have unit stride along K."""
    return w if w.stride(-1) == 1 else w.contiguous()


def _pow2(v: int) -> int:
    return 1 << max(0, (int(v) - 1).bit_length())


def warps_by_width(width: int, cols_per_warp: int) -> int:
    """Warps for a program holding rows of ``width`` columns: pow2(width) / cols_per_warp, >= 1."""
    return max(1, _pow2(width) // cols_per_warp)


class Packed(NamedTuple):
    """The gate kernel's output: TwELL slots plus the dense overflow buffer."""
    vals: Tensor     # [M, n_tiles, slots]
    cols: Tensor     # [M, n_tiles, slots] int16
    counts: Tensor   # [M, n_tiles] int32, may exceed slots
    oslot: Tensor    # [M, n_tiles] int32, valid where counts > slots: row of ovals, or -1
    ovals: Tensor    # [capacity, tile_n]
    ocount: Tensor   # [1] int32: overflow tiles seen (may exceed capacity)


def gate_pack(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], tile_n: int, slots: int) -> Packed:
    """relu(x2 W_g^T + b_g) in TwELL, written by the GEMM's epilogue. x2 is [M, K]."""
    from twell_compile.kernels.twell_gate import gate_twell_kernel

    m, k = x2.shape
    n = w_gate.shape[0]
    nt = -(-n // tile_n)
    dev = x2.device
    vals = torch.empty((m, nt, slots), dtype=x2.dtype, device=dev)
    cols = torch.empty((m, nt, slots), dtype=torch.int16, device=dev)
    counts = torch.empty((m, nt), dtype=torch.int32, device=dev)
    oslot = torch.empty((m, nt), dtype=torch.int32, device=dev)
    ocap = max(1, -(-m * nt // OVF_DIV))
    ovals = torch.empty((ocap, tile_n), dtype=x2.dtype, device=dev)
    ocount = torch.zeros(1, dtype=torch.int32, device=dev)
    block_m = GATE_BLOCK_M if m > 64 else 64
    grid = (-(-m // block_m) * nt,)
    gate_twell_kernel[grid](
        x2, x2.stride(0), x2.stride(1), w_gate, w_gate.stride(0), w_gate.stride(1),
        b_gate if b_gate is not None else x2,
        vals, cols, counts, oslot, ovals, ocount, m, n, k, nt, ocap,
        HAS_B=b_gate is not None, BLOCK_M=block_m, TILE=tile_n, BLOCK_K=GATE_BLOCK_K,
        SLOTS=slots, SLOTS_P=_pow2(slots), GROUP_M=8, EPI=GATE_EPI,
        EVEN_K=k % GATE_BLOCK_K == 0,
        num_warps=GATE_WARPS, num_stages=GATE_STAGES if tile_n <= 128 else 3)
    return Packed(vals, cols, counts, oslot, ovals, ocount)


def fused(x2: Tensor, pk: Packed, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
          b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(y [M, K_out], sum |h| per row [M] fp32) from the packed gate activations."""
    from twell_compile.kernels.twell_fused import twell_ffn_kernel

    m, k = x2.shape
    n, k_out = w_gate.shape[0], w_down.shape[0]
    nt, slots = pk.vals.shape[1], pk.vals.shape[2]
    tile_n = pk.ovals.shape[1]
    wdt = _transposed(w_down)   # per call: ~15 us of ~1 ms, never stale
    wu = w_up if w_up is not None else w_gate
    y = torch.empty((m, k_out), dtype=x2.dtype, device=x2.device)
    hsum = torch.empty((m,), dtype=torch.float32, device=x2.device)
    kp = _pow2(max(k, k_out))
    twell_ffn_kernel[(m,)](
        x2, x2.stride(0), x2.stride(1), pk.vals, pk.cols, pk.counts, pk.oslot, pk.ovals,
        w_gate, w_gate.stride(0), w_gate.stride(1), b_gate if b_gate is not None else x2,
        wu, wu.stride(0), wu.stride(1), b_up if b_up is not None else x2,
        wdt, wdt.stride(0), wdt.stride(1), b_down if b_down is not None else x2,
        y, y.stride(0), y.stride(1), hsum, k, n, k_out, nt,
        GATED=w_up is not None, HAS_BG=b_gate is not None, HAS_BU=b_up is not None,
        HAS_BD=b_down is not None, TILE=tile_n, SLOTS=slots, NT_P=_pow2(nt), K_P=_pow2(k),
        KO_P=_pow2(k_out), PAIRS=PAIRS, num_warps=FUSED_WARPS or (8 if kp >= 2048 else 4))
    return y, hsum


def twell_forward_tiles(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                        b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
                        tile_n: int, slots: int) -> tuple[Tensor, Tensor, Tensor]:
    """Tile path: (y [M, K_out], counts [M, n_tiles] int32, sum|h| per row [M] fp32)."""
    w_gate = _rows(w_gate)
    w_up = None if w_up is None else _rows(w_up)
    pk = gate_pack(x2, w_gate, b_gate, tile_n, slots)
    y, hsum = fused(x2, pk, w_gate, b_gate, w_up, b_up, w_down, b_down)
    return y, pk.counts, hsum


def list_width(n: int, nnz_per_row: Optional[float] = None) -> int:
    """Per-row list width W: a power of two >= 4x the mean non-zeros per row + 32 (tail 0.2,
    mean 51: W=128 left 10% of rows over it, 1.33 vs ~0.9 ms fused on H200), clamped to [MIN_WIDTH, MAX_LIST] and to pow2(N). Rows over
    W stay exact (tail over g), only slower."""
    w = MIN_WIDTH if nnz_per_row is None else _pow2(int(4 * nnz_per_row) + 32)
    return max(1, min(max(w, MIN_WIDTH), MAX_LIST, _pow2(n)))


class Rows(NamedTuple):
    """Gate output of the per-row path."""
    g: Tensor        # [M, N] pre-activation (cuBLAS), read again only by the exact tail
    lst: Tensor      # [M, W] int32: first W non-zeros of relu(g) per row, (col << 16) | bits
    cnt: Tensor      # [M] int32 non-zeros per row (may exceed W); slots >= cnt unwritten
    order: Tensor    # [M] int32 permutation of the rows, those with cnt > W first

    @property
    def cols(self) -> Tensor:
        return (self.lst >> 16) & 0xFFFF

    @property
    def vals(self) -> Tensor:
        return (self.lst & 0xFFFF).to(torch.int16).view(self.g.dtype)


def gate_rows(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], width: int) -> Rows:
    """g = x2 W_g^T + b_g by cuBLAS, then one compaction pass over g."""
    from twell_compile.kernels.twell_rows import compact_rows_kernel

    m = x2.shape[0]
    n = w_gate.shape[0]
    g = F.linear(x2, w_gate, b_gate)
    lst = torch.empty((m, width), dtype=torch.int32, device=x2.device)
    cnt = torch.empty((m,), dtype=torch.int32, device=x2.device)
    order = torch.empty((m,), dtype=torch.int32, device=x2.device)
    if m:
        ctr = torch.zeros((2,), dtype=torch.int32, device=x2.device)
        compact_rows_kernel[(-(-m // COMPACT_BM),)](
            g, g.stride(0), lst, cnt, order, ctr, m, n, width,
            BM=COMPACT_BM, CH=min(COMPACT_CH, _pow2(n)), ASM=not _INTERPRET,
            num_warps=COMPACT_WARPS)
    return Rows(g, lst, cnt, order)


def fused_rows(x2: Tensor, r: Rows, w_up: Optional[Tensor], b_up: Optional[Tensor],
               w_down: Tensor, b_down: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(y [M, K_out], sum |h| per row [M] fp32) from the per-row lists."""
    from twell_compile.kernels.twell_rows import twell_rows_kernel

    m, k = x2.shape
    n, k_out = r.g.shape[1], w_down.shape[0]
    wdt = _transposed(w_down)   # per call: ~15 us of ~1 ms, never stale
    wu = w_up if w_up is not None else wdt
    y = torch.empty((m, k_out), dtype=x2.dtype, device=x2.device)
    hsum = torch.empty((m,), dtype=torch.float32, device=x2.device)
    if m == 0:
        return y, hsum
    twell_rows_kernel[(m,)](
        x2, x2.stride(0), x2.stride(1), r.g, r.g.stride(0), r.lst, r.cnt, r.order,
        wu, wu.stride(0), wu.stride(1), b_up if b_up is not None else x2,
        wdt, wdt.stride(0), wdt.stride(1), b_down if b_down is not None else x2,
        y, y.stride(0), y.stride(1), hsum, k, n, k_out, r.lst.shape[1],
        GATED=w_up is not None, HAS_BU=b_up is not None, HAS_BD=b_down is not None,
        K_P=_pow2(k), KO_P=_pow2(k_out), PAIRS=ROW_PAIRS, CH=min(TAIL_CH, _pow2(n)), PF=ROW_PF,
        num_warps=warps_by_width(max(k, k_out), ROW_COLS_PER_WARP))
    return y, hsum


def twell_forward(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                  b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
                  tile_n: int = 128, slots: int = 16, width: Optional[int] = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """(y [M, K_out], non-zeros per row [M] int32, sum|h| per row [M] fp32). x2 is [M, K].

    width: the per-row list width W (default ``list_width(N)``); tile_n/slots are the tile
    path's and unused here."""
    n = w_gate.shape[0]
    if n > 65536:
        raise ValueError(f"per-row TwELL path packs columns in 16 bits: N={n} > 65536")
    w_up = None if w_up is None else _rows(w_up)
    r = gate_rows(x2, w_gate, b_gate, width or list_width(n))
    y, hsum = fused_rows(x2, r, w_up, b_up, w_down, b_down)
    return y, r.cnt, hsum


EAGER_ELEMENTWISE_MAX_M = 1024   # dense_forward without counts: eager's relu and mul up to here
DENSE_BLOCK = 1024     # columns per step of relu_mul_rows_kernel
DENSE_PROGRAMS = 264   # split rows into column spans below this many programs (2 per H200/H100 SM)


def dense_forward(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                  b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor], counts: bool = True
                  ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Eager's GEMMs, bit-identical to eager. Returns (y, non-zeros of relu(g) per row [M] int32
    (NaN counted), sum of |h| per row [M] fp32).

    relu (* up) is one Triton pass (relu_mul_rows_kernel) that also takes the counts and sums
    the statistics and the density probe need: no extra pass over [M, N] for them. Without
    ``counts`` (no statistics, no probe) and for M <= EAGER_ELEMENTWISE_MAX_M, eager's own relu
    and mul run instead (no counts returned): two aten calls cost less host time than the
    Triton launch's bookkeeping, and the extra pass over [M, N] is small there.
    """
    g = F.linear(x2, w_gate, b_gate)
    if not counts and x2.shape[0] <= EAGER_ELEMENTWISE_MAX_M:
        h = torch.relu(g) if w_up is None else torch.relu(g) * F.linear(x2, w_up, b_up)
        return F.linear(h, w_down, b_down), None, None
    h, cnt, asum = relu_mul_rows(g, None if w_up is None else F.linear(x2, w_up, b_up))
    return F.linear(h, w_down, b_down), cnt, asum


def _graph_dense(x2: Tensor, k: int, n: int, k_out: int, gated: bool) -> bool:
    """Whether this dense call replays its own graph: decode sizes where eager's calls are
    host-bound (cuda_policy.dense_host_bound), graphs usable. Not under
    torch.use_deterministic_algorithms: cuBLAS may pick another kernel inside a capture than
    eagerly (the first calls run eagerly), and the bits would change between calls."""
    return (x2.shape[0] <= cuda_policy.DECODE_MAX_M and decode_graphs.usable(x2)
            and not torch.are_deterministic_algorithms_enabled()
            and cuda_policy.dense_host_bound(k, n, k_out, gated, x2.element_size()))


def _dense_graphed(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                   b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor]) -> Tensor:
    """dense_forward without statistics at decode sizes, replayed from the op's own CUDA graph
    (decode_graphs: eager's five calls cost more host time than the GEMMs' GPU time there)."""
    key = (("dense", x2.shape, x2.dtype, x2.device, decode_graphs.math_mode())
           + decode_graphs.weights_key(w_gate, b_gate, w_up, b_up, w_down, b_down))
    return decode_graphs.run(key, x2, lambda xs: dense_forward(
        xs, w_gate, b_gate, w_up, b_up, w_down, b_down, counts=False)[:1])[0]


def relu_mul_rows(g: Tensor, u: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(relu(g) * u, or relu(g) when u is None; its non-zero count per row [M] int32; sum |h|
    per row [M] fp32) for 2-D g, u.

    One program per (row, span of columns); a row is split into spans while there are fewer
    than DENSE_PROGRAMS rows, and the spans' counts and sums are then added atomically into
    zeroed buffers (one memset).
    """
    from twell_compile.kernels.relu_mul import relu_mul_rows_kernel

    m, n = g.shape
    if g.stride(-1) != 1:
        g = g.contiguous()
    if u is not None and u.stride(-1) != 1:
        u = u.contiguous()
    h = torch.empty((m, n), dtype=g.dtype, device=g.device)
    block = min(DENSE_BLOCK, _pow2(n)) if n else 1
    steps = -(-n // block)
    split = max(1, min(steps, -(-DENSE_PROGRAMS // max(m, 1))))
    span = -(-steps // split) * block
    split = -(-n // span) if n else 1
    # counts and sums share one int32 buffer (zero bits are 0.0f): one memset when split > 1
    buf = (torch.zeros if split > 1 or not n else torch.empty)((2, m), dtype=torch.int32, device=g.device)
    cnt, asum = buf[0], buf[1].view(torch.float32)
    if m and n:
        uu = u if u is not None else g
        launch(relu_mul_rows_kernel, (m, split),
               (g, uu, h, cnt, asum, n, span, g.stride(0), uu.stride(0), h.stride(0)),
               dict(GATED=u is not None, ATOMIC=split > 1, BLOCK=block), num_warps=4)
    return h, cnt, asum


def ffn_infer(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
              b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
              tile_n: int, slots: int, layer: str, keep_stats: bool) -> Tensor:
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n, k_out = x2.shape[0], w_gate.shape[0], w_down.shape[0]
    gated = w_up is not None
    key = (layer, x.device, x.dtype, k, n, k_out, gated)
    form = None
    # decode sizes: the decode rule at the layer's measured density; where it cannot pick
    # decode even at density 0 (its best case), the bookkeeping-free dense path
    decode = cuda_policy.decode_ok(x, m, n)
    if decode:
        form = cuda_policy.use_decode(key, m, k, n, k_out, gated)
        decode = form is not None or cuda_policy.decode_wins(0.0, m, k, n, k_out, gated)
    if not decode and not cuda_policy.shape_ok(x, m, k, k_out, n, tile_n, slots):
        # Fast path: eager's calls (fp32, M between the sparse paths, unsupported shapes); no
        # policy bookkeeping.
        if not keep_stats and _graph_dense(x2, k, n, k_out, gated):
            y = _dense_graphed(x2, w_gate, b_gate, w_up, b_up, w_down, b_down)
            return y.reshape(*x.shape[:-1], k_out)
        y, per_token, hsum = dense_forward(x2, w_gate, b_gate, w_up, b_up, w_down, b_down, counts=keep_stats)
        if keep_stats:
            stats.record(layer, per_token, hsum.sum(), per_token.new_zeros(()), n)
        return y.reshape(*x.shape[:-1], k_out)
    sparse = form is not None if decode else cuda_policy.use_twell(key, gated, k, n, k_out, x.element_size())
    probe = cuda_policy.wants_probe(key, sparse)
    if sparse and decode:
        from twell_compile.kernels.cuda_decode import decode_forward

        # the kernel fills the layer's statistics buffer itself: no extra launches
        sbuf = stats.device_buffer(layer, x.device, m, n) if keep_stats else None
        y, tok, hsum = decode_forward(x2, w_gate, b_gate, w_up, b_up, w_down, b_down, stats_buf=sbuf,
                                      form=form, graphed=True)
        if probe:
            cuda_policy.submit(key, tok[m], m * n)
    elif sparse:
        width = list_width(n, cuda_policy.density(key) * n)
        y, per_token, hsum = twell_forward(x2, w_gate, b_gate, w_up, b_up, w_down, b_down,
                                           width=width)
        if keep_stats:
            stats.record(layer, per_token, hsum.sum(), (per_token > width).sum(), n)
        if probe:
            cuda_policy.submit(key, per_token.sum(), m * n)
    elif not keep_stats and not probe and _graph_dense(x2, k, n, k_out, gated):
        y = _dense_graphed(x2, w_gate, b_gate, w_up, b_up, w_down, b_down)
    else:
        y, per_token, hsum = dense_forward(x2, w_gate, b_gate, w_up, b_up, w_down, b_down)
        if keep_stats:
            stats.record(layer, per_token, hsum.sum(), per_token.new_zeros(()), n)
        if probe:
            cuda_policy.submit(key, per_token.sum(), m * n)
    cuda_policy.tick(key)
    return y.reshape(*x.shape[:-1], k_out)
