"""CUDA training FFN (twell::ffn_train / ffn_train_bwd), bf16/fp16: sparse or dense per call,
no host sync. The sparse forward saves the compact hybrid state (formats.Hybrid); the dense
forward saves either the same compact state or g and u whole, as a backup of all M rows
(backup_idx = 0..M-1; the ELL part unwritten). The backward reads g-and-u from the backup's
row count (M; a compact state needs cap < M), and densify-or-sparse for a compact state from
the state itself: the forward marks its backup_idx with the backward it takes (``mark_backward``;
both exact on any compact state).

Sparse forward, for x [M, K]:
  1. cuBLAS gate GEMM g = x W_g^T + b_g, then ``cuda_infer.compact_rows`` (twell_rows.py): the
     count of relu(g)'s non-zeros per row and its first W as packed (col, value) pairs.
  2. ``train_fwd_kernel`` (twell_train_fwd.py): per row, u at the listed pairs, y; writes the
     ELL slots; busy rows take a dense-backup slot from an atomic counter (rows past its
     capacity are recomputed in the backward, decided on the device).
Sparse backward: ``rank_kernel`` (twell_train_bwd.py) ranks the quiet rows' ELL slots in
their columns and lists the busy rows, which ``train_bwd_kernel`` does whole (dense backup,
or recomputed); a counting sort
groups the slots by neuron; ``wgrad_kernel`` (twell_train_wgrad.py) runs twice per neuron:
the DY pass (dh, d_g, d_u at each slot, dW_d^T[n], bias grads; dy rows gathered) and the X
pass (dW_g[n], dW_u[n]; x rows gathered), on top of the dense-backup rows' cuBLAS products,
recomputing the few rows past the backup; ``dx_rows_kernel`` gives the quiet rows' dx from
W_g and W_u rows. No [M, N] buffer anywhere.
Dense forward: cuBLAS g, u, relu*u (relu_mul.py, which also counts the non-zeros per row), y.
It saves the compact state (the compaction and ``train_fwd_kernel`` with Y=False over g and
u) while the layer's last measurement lost no rows past the backup (the "compact" path),
else g and u. Backward from g and u: dh = dy W_d, one elementwise pass (twell_train_dense.py), five
more cuBLAS products; from the compact state (``backward_densify``): dh = dy W_d,
``train_densify_kernel`` (twell_train_densify.py) writing d_g, d_u and h whole, the same five
products. Eager's nine GEMMs either way (docs/design-notes/training.md: a backward recomputing
g and u, eleven GEMMs, lost).

Which path runs is select.plan_train's choice; launch sizes come from the device's record.
The sparse path's stages are public functions the op composes (``gate_gemm``, ``pack_gate``,
``packed_forward``; ``sparse_bwd_setup``, ``sparse_bwd_dy_pass``, ``sparse_bwd_x_pass``,
``sparse_bwd_dx``, ``sparse_bwd_outputs``), so benchmarks/train_parts.py times each one as the
op calls it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from twell_compile import stats
from twell_compile.kernels.twell_train_bwd import backup_rows_kernel, dx_rows_kernel, rank_kernel, train_bwd_kernel
from twell_compile.kernels.twell_train_dense import train_dense_bwd_kernel
from twell_compile.kernels.twell_train_densify import train_densify_kernel
from twell_compile.kernels.twell_train_fwd import train_fwd_kernel
from twell_compile.kernels.twell_train_wgrad import chunk_map_kernel, scatter_kernel, wgrad_kernel, wgrad_plan_kernel
from twell_compile.reference import ACTS
from twell_compile.runtime import arch, density
from twell_compile.runtime.cuda_infer import Rows, compact_rows, record_stats, relu_mul_rows
from twell_compile.runtime.launch import launch, pow2, sm_count, transposed, unit_rows, warps_by_width
from twell_compile.runtime.paths import TRAIN_PATHS
from twell_compile.runtime.select import TrainPlan

CH = 256          # columns per scan step over g / backup rows
RBK = 64          # K per recompute step in the backward (CH columns x RBK)
EW_BM, EW_BN = 32, 128   # tile of the dense backward's elementwise pass (and its bias sums)
DENSIFY_CH = 2048   # columns per streamed step of train_densify_kernel (16 per thread at 4 warps)

# A compact state's backward: densify (the forward ran dense) or sparse, carried by the state:
# an attribute of its backup_idx tensor, which reaches ffn_train_bwd as the same tensor object
# (saved by the op's autograd as a non-differentiable output; AOTAutograd passes its saved
# tensors through; activation checkpointing's recompute marks the state it makes). Only a speed
# choice: both backward paths are exact for any hybrid state, and an unmarked state (one made
# anew from others, e.g. the experts op's concatenation) takes the sparse one.
BACKWARD = "twell_backward"        # the attribute's name
COMPACT_BACKWARDS = ("densify", "sparse")


def mark_backward(bidx: Tensor, backward: str) -> None:
    """Mark the compact state whose backup_idx is ``bidx`` with the backward it takes
    ("densify": the dense forward saved it; "sparse"), read by ``backward_path``."""
    if backward not in COMPACT_BACKWARDS:
        raise ValueError(f"backward must be one of {COMPACT_BACKWARDS}, got {backward!r}")
    setattr(bidx, BACKWARD, backward)


def clear_hints() -> None:
    """Forget which layers' kernels are warm (runtime reset)."""
    _warm.clear()


# Layers whose every path's Triton kernels are compiled: a layer switching path mid-run (its
# density crossing sparse_max_density) otherwise compiled the new path's kernels in that step
# (seconds, against 70 ms steps). Keyed by everything the kernels specialize on.
_warm: set = set()


def warm_paths(plan: TrainPlan, x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
               b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor], l1_scale: float,
               keep_stats: bool, act: str = "relu", l1_coef: Optional[Tensor] = None) -> None:
    """Before a layer's first call that may switch path (path='auto'), run the other paths'
    forward and backward once on its inputs, outputs discarded, so every kernel it can take is
    compiled in the call that compiles anyway (the first); with ``keep_stats`` the statistics
    kernel too, into a scratch buffer (each path launches its own variant). Nothing is measured
    or recorded; not under CUDA-graph capture or inside a backward pass."""
    if torch.cuda.is_current_stream_capturing() or torch._C._current_graph_task_id() != -1:
        return
    key = (x.shape[-1], x.numel() // max(x.shape[-1], 1), x.dtype, x.device, tuple(w_gate.shape), w_up is not None,
           b_gate is not None, b_up is not None, b_down is not None, tuple(w_down.shape), plan.width, plan.cap,
           bool(l1_scale), l1_coef is not None, keep_stats, act, arch.launch_policy(x.device).name)
    if key in _warm:
        return
    _warm.add(key)
    with torch.no_grad():
        dy = torch.zeros((*x.shape[:-1], w_down.shape[0]), dtype=x.dtype, device=x.device)
        for path in TRAIN_PATHS:
            if path in ("auto", plan.path):
                continue
            out = ffn_train_forward(plan._replace(path=path, probe=False, tick=False), x, w_gate, b_gate, w_up,
                                    b_up, w_down, b_down, None, keep_stats, act)
            ffn_train_backward(dy, x, w_gate, b_gate, w_up, b_up, w_down, *out[1:], l1_scale=l1_scale, act=act,
                               l1_coef=l1_coef)


def _warps(k: int, k_out: int) -> int:
    return 8 if pow2(max(k, k_out)) > 2048 else 4


class Packed(NamedTuple):
    """The sparse state's buffers after the compaction (``pack_gate``), before
    ``packed_forward`` fills the ELL slots and the dense backup."""
    rows: Rows            # compact_rows' per-row lists, counts and order
    cols: Tensor          # [M, W] int32 ELL columns (zeros)
    ell_g: Tensor         # [M, W] relu(g) at the slots (zeros)
    ell_u: Tensor         # [M, W] u at the slots ([M, 0] non-gated)
    bidx: Tensor          # [C] int64 dense-backup rows (-1)
    bg: Tensor            # [C, N] backup g (zeros)
    bu: Tensor            # [C, N] backup u ([C, 0] non-gated)
    ctr: Tensor           # [3] int32: backup slots taken, the order's two buckets


def pack_gate(g: Tensor, width: int, cap: int, gated: bool) -> Packed:
    """The compaction of the gate output g [M, N]: the state's buffers allocated (zeroed: a few
    memsets) and ``cuda_infer.compact_rows`` (one launch: each row's non-zero count of relu(g)
    and its first ``width`` as packed (col, value) pairs, the rows' order by cost). The first
    half of the training forward's state (``hybrid_state``); public so benchmarks/train_parts.py
    times the calls the op makes."""
    m, n = g.shape
    dev, dt = g.device, g.dtype
    cols = torch.zeros((m, width), dtype=torch.int32, device=dev)
    ell_g = torch.zeros((m, width), dtype=dt, device=dev)
    ell_u = torch.zeros((m, width if gated else 0), dtype=dt, device=dev)
    bidx = torch.full((cap,), -1, dtype=torch.int64, device=dev)
    bg = torch.zeros((cap, n), dtype=dt, device=dev)
    bu = torch.zeros((cap, n if gated else 0), dtype=dt, device=dev)
    ctr = torch.zeros((3,), dtype=torch.int32, device=dev)     # backup slots; the order's two
    rows = compact_rows(g, width, ctr[1:])
    return Packed(rows, cols, ell_g, ell_u, bidx, bg, bu, ctr)


def packed_forward(x2: Tensor, g: Tensor, u: Optional[Tensor], pk: Packed, w_up: Optional[Tensor],
                   b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor], compute_y: bool,
                   act: str = "relu"):
    """``train_fwd_kernel`` over a ``pack_gate`` result (one launch): per row, u at the listed
    pairs (read from ``u`` where given, else from W_up rows), y when ``compute_y``, the ELL
    slots, and a dense-backup slot for each row over the width (the slot counter pk.ctr[0] is
    atomic: calling this twice on one pack gives the second call's busy rows no slot, so a
    benchmark repeating it measures the same work only where no row is busy). Returns (y or
    None, hsum or None, counts, cols, ell_g, ell_u, backup_idx, backup_g, backup_u, missing
    rows [0-d])."""
    p = arch.launch_policy(x2.device)
    m, k = x2.shape
    n, k_out = g.shape[1], w_down.shape[0]
    dev, dt = x2.device, x2.dtype
    gated = w_up is not None
    width, cap = pk.cols.shape[1], pk.bidx.shape[0]
    lst, cnt, order = pk.rows.lst, pk.rows.cnt, pk.rows.order
    cols, ell_g, ell_u, bidx, bg, bu, ctr = pk.cols, pk.ell_g, pk.ell_u, pk.bidx, pk.bg, pk.bu, pk.ctr
    y = torch.empty((m, k_out), dtype=dt, device=dev) if compute_y else None
    hsum = torch.empty((m,), dtype=torch.float32, device=dev) if compute_y else None
    if m:
        wdt = transposed(w_down) if compute_y else g
        wu = w_up if (compute_y and gated) else g
        pairs, cpw = (p.fwd_pairs, p.fwd_cols_per_warp) if compute_y else (p.state_pairs, p.state_cols_per_warp)
        launch(train_fwd_kernel, (m,), (
            x2, x2.stride(0), g, g.stride(0), lst, cnt, order,
            u if u is not None else g, u.stride(0) if u is not None else 0,
            wu, wu.stride(0), b_up if b_up is not None else g,
            wdt, wdt.stride(0), b_down if b_down is not None else g,
            y if y is not None else g, y.stride(0) if y is not None else 0,
            hsum if hsum is not None else cnt,
            cols, ell_g, ell_u, bidx, bg, bu, ctr,
            m, k, n, k_out, width, cap),
            dict(GATED=gated, HAS_BU=b_up is not None, HAS_BD=b_down is not None, Y=compute_y,
                 K_P=pow2(k), KO_P=pow2(k_out), PAIRS=pairs, CH=min(CH, pow2(n)), ACT=ACTS.index(act)),
            num_warps=warps_by_width(max(k, k_out), cpw))
    missing = (ctr[0] - cap).clamp(min=0)
    return y, hsum, cnt, cols, ell_g, ell_u, bidx, bg, bu, missing


def hybrid_state(x2: Tensor, g: Tensor, u: Optional[Tensor], w_up: Optional[Tensor], b_up: Optional[Tensor],
                 w_down: Tensor, b_down: Optional[Tensor], width: int, cap: int, compute_y: bool,
                 act: str = "relu"):
    """Compaction + train_fwd_kernel (``pack_gate`` then ``packed_forward``). Returns (y or
    None, hsum or None, counts, cols, ell_g, ell_u, backup_idx, backup_g, backup_u, missing
    rows [0-d]). Public so benchmarks/bench_ffn_train.py times it as the op calls it."""
    pk = pack_gate(g, width, cap, w_up is not None)
    return packed_forward(x2, g, u, pk, w_up, b_up, w_down, b_down, compute_y, act)


def gate_gemm(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor]) -> Tensor:
    """g = x W_g^T + b_g by cuBLAS: the first launch of both training forwards (public so
    benchmarks/train_parts.py times the call the op makes)."""
    return F.linear(x2, w_gate, b_gate)


def forward_sparse(x2, w_gate, b_gate, w_up, b_up, w_down, b_down, width, cap, act="relu"):
    w_up = None if w_up is None else unit_rows(w_up)
    g = gate_gemm(x2, w_gate, b_gate)
    return hybrid_state(x2, g, None, w_up, b_up, w_down, b_down, width, cap, True, act)


def forward_dense(x2, w_gate, b_gate, w_up, b_up, w_down, b_down, width, cap, compact=False,
                  count_lost=True, act="relu"):
    """cuBLAS forward, bit-identical to eager: (y, sum |h| per row [M] fp32, state). The state
    is (counts, cols, ell_g, ell_u, backup_idx, backup_g, backup_u, missing [0-d]) with g and u
    as a backup of all M rows; cols and the ELL values are left unwritten (the dense backward
    reads g and u only). relu(g)*u is the inference dense path's pass, which also counts
    non-zeros and sums |h| per row (the probe and the statistics). ``missing`` is the rows the
    sparse path could not have kept (rows over ``width`` past a backup of ``cap``), so the
    plan's lost-row penalty sees them from dense calls too (else a layer flips back to sparse
    every other call). ``count_lost=False`` (no probe this call):
    None, and three small launches fewer.

    ``compact``: save the hybrid state instead (the compaction and ``train_fwd_kernel`` with
    Y=False over g and u): a sparse path's memory at dense speed, its backward
    ``backward_densify``; taken while the layer's last measurement lost no rows."""
    m = x2.shape[0]
    dev, dt = x2.device, x2.dtype
    g = gate_gemm(x2, w_gate, b_gate)
    u = None if w_up is None else F.linear(x2, w_up, b_up)
    h, cnt, hsum = relu_mul_rows(g, u, act)
    y = F.linear(h, w_down, b_down)
    del h
    if compact:
        _, _, *state = hybrid_state(x2, g, u, w_up, b_up, w_down, b_down, width, cap, False, act)
        return y, hsum, tuple(state)
    cols = torch.empty((m, width), dtype=torch.int32, device=dev)
    ell_g = torch.empty((m, width), dtype=dt, device=dev)
    ell_u = torch.empty((m, width if u is not None else 0), dtype=dt, device=dev)
    bidx = torch.arange(m, dtype=torch.int64, device=dev)
    bu = u if u is not None else g.new_empty((m, 0))
    missing = ((cnt > width).sum(dtype=torch.int32) - cap).clamp(min=0) if count_lost else None
    return y, hsum, (cnt, cols, ell_g, ell_u, bidx, g, bu, missing)


def ffn_train_forward(plan: TrainPlan, x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor],
                      w_up: Optional[Tensor], b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
                      layer: Optional[str], keep_stats: bool, act: str = "relu") -> tuple[Tensor, ...]:
    """Runs a CUDA training plan (path "twell", "compact" or "dense"; select.plan_train) of the
    activation ``act`` (the state holds relu(g) and u whatever it is).
    ``layer`` None (warm_paths): statistics, if kept, go to a scratch buffer."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n, k_out = x2.shape[0], w_gate.shape[0], w_down.shape[0]
    width, cap = plan.width, plan.cap
    sparse, compact = plan.path == "twell", plan.path == "compact"
    if sparse:
        y, hsum, cnt, *rest = forward_sparse(x2, w_gate, b_gate, w_up, b_up, w_down, b_down, width, cap, act)
        missing = rest[-1]
        if keep_stats:
            record_stats(layer, cnt, hsum, n, lost=missing)
    else:
        y, hsum, (cnt, *rest) = forward_dense(x2, w_gate, b_gate, w_up, b_up, w_down, b_down,
                                              width, cap, compact, count_lost=plan.probe, act=act)
        missing = rest[-1]                 # lost rows (compact) or what sparse would lose
        if keep_stats:
            record_stats(layer, cnt, hsum, n, lost=missing if compact else None)
    if plan.probe:
        density.submit(plan.key, cnt.sum() + missing * plan.policy.lost_row_pairs, m * n)
        density.submit(plan.lost_key, missing, 1)
    if keep_stats and layer is not None:
        stats.record_fired(layer, fired_units(cnt, rest[0], rest[4], n, dense=not (sparse or compact)), m)
    if sparse or compact:                  # a compact state: it carries its backward
        mark_backward(rest[3], "densify" if compact else "sparse")
    return (y.reshape(*x.shape[:-1], k_out), cnt, *rest[:-1])


def fired_units(cnt: Tensor, cols: Tensor, bg: Tensor, n: int, dense: bool) -> Tensor:
    """[N] bool: the hidden units non-zero on at least one row of the saved state. ``dense``:
    ``bg`` is g of every row (g > 0). Compact: the ELL slots of rows within the width, and the
    dense-backup rows (zero where unused); rows past the backup are not looked at."""
    if dense:
        return (bg > 0).any(0) if bg.shape[0] else bg.new_zeros((n,), dtype=torch.bool)
    width = cols.shape[1]
    live = (torch.arange(width, device=cols.device) < cnt.unsqueeze(1)) & (cnt <= width).unsqueeze(1)
    flags = torch.zeros((n + 1,), dtype=torch.bool, device=cols.device)
    flags.index_fill_(0, torch.where(live, cols, n).reshape(-1).long(), True)   # masked slots: the extra entry
    fired = flags[:n]
    if bg.shape[0]:
        fired = fired | (bg > 0).any(0)
    return fired


class SparseBwd:
    """The sparse backward between its stages (``sparse_bwd_setup`` makes it; the DY pass, the
    X pass and dx read and fill it; ``sparse_bwd_outputs`` casts its results). Stage by stage so
    that benchmarks/train_parts.py times the launches the op makes, one stage at a time."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def sparse_bwd_setup(dy2, x2, w_gate, b_gate, w_up, b_up, w_down, cnt, cols, ell_g, ell_u,
                     bidx, bg, bu, l1c, act="relu", l1_coef=None) -> SparseBwd:
    """The sparse backward up to its per-neuron passes: ``backup_rows_kernel`` (each row's
    dense-backup slot, the slots' x and dy rows gathered), ``rank_kernel`` (the quiet rows' ELL
    slots ranked in their columns, the busy rows listed), ``train_bwd_kernel`` (busy rows whole:
    dense backup, or listed for recompute), ``wgrad_plan_kernel`` (the counting sort's offsets,
    the chunk length and each neuron's chunks), the counting sort by neuron
    (``scatter_kernel``), the dense-backup rows' three cuBLAS products (fp32, into the weight
    gradients the passes complete), and the chunk map of the neurons' lists
    (``chunk_map_kernel``); with the buffers' allocations and memsets. Host work: a few small
    calls besides the launches (the setup's scans and gathers are kernels: a training step was
    host-bound on slow hosts, docs/training-design.md)."""
    p = arch.launch_policy(x2.device)
    m, k = x2.shape
    n, k_out = w_gate.shape[0], w_down.shape[0]
    width = cols.shape[1]
    dev, dt = x2.device, x2.dtype
    gated = w_up is not None
    cap = bidx.shape[0]
    f32, i32 = torch.float32, torch.int32
    dx = torch.empty((m, k), dtype=dt, device=dev)
    # quiet rows: ranks in their columns, per-column counts; d_g, d_u per slot (fp32)
    rk = torch.empty((m, width), dtype=i32, device=dev)
    q = torch.empty((m,), dtype=i32, device=dev)
    bkw = min(p.wg_bk, pow2(k))
    # the zeroed buffers in one allocation per dtype (one memset each): int32 per-column counts,
    # the two list counters and the passes' tickets (DY pass, X pass per K chunk); the backup
    # rows' dense d_g, d_u, dh [C, N]; the fp32 bias sums
    nt = 1 + -(-k // bkw)
    hist, mctr, bctr, tickets = torch.zeros(n + 2 + nt, dtype=i32, device=dev).split_with_sizes([n, 1, 1, nt])
    backup = torch.zeros((3 if gated else 2, cap, n), dtype=dt, device=dev).unbind(0)
    sg, sh = backup[0], backup[-1]
    su = backup[1] if gated else sg
    db = torch.zeros((2, n), dtype=f32, device=dev)
    eg = torch.empty((m, width), dtype=f32, device=dev)
    eu = torch.empty((m, width), dtype=f32, device=dev) if gated else eg
    mlist = torch.empty((max(m, 1),), dtype=i32, device=dev)
    w_gate = unit_rows(w_gate)
    wu = unit_rows(w_up) if gated else w_gate
    wdt = transposed(w_down)
    blist = torch.empty((max(m, 1),), dtype=i32, device=dev)
    # each row's backup slot (-1: none) and the slots' x and dy rows (padding slots: zero rows)
    slot_of, xb, dyb = backup_slots(bidx, m, x2, dy2)
    if m:
        launch(rank_kernel, (-(-m // p.rank_bm),),
               (x2, x2.stride(0), dy2, dy2.stride(0), cnt, cols, width, q, rk, hist, blist, bctr, m, k, k_out),
               dict(BM=p.rank_bm, BK=min(256, pow2(max(k, k_out))), BP=p.rank_bp), num_warps=4)
        launch(train_bwd_kernel, (min(m, p.busy_programs),),
               (dy2, dy2.stride(0), x2, x2.stride(0), blist, bctr,
                slot_of, bg, bu if gated else bg,
                w_gate, w_gate.stride(0), b_gate if b_gate is not None else w_gate,
                wu, wu.stride(0), b_up if b_up is not None else w_gate, wdt, wdt.stride(0),
                dx, dx.stride(0), sg, su, sh, mlist, mctr,
                k, n, k_out, float(l1c), l1_coef if l1_coef is not None else cnt),
               dict(GATED=gated, HAS_BG=b_gate is not None, HAS_BU=b_up is not None, L1=bool(l1c),
                    L1_DEV=l1_coef is not None, K_P=pow2(k), KO_P=pow2(k_out), PAIRS=p.train_pairs,
                    CH=min(CH, pow2(n)), BK=RBK, ACT=ACTS.index(act)),
               num_warps=_warps(k, k_out))
    # the counting sort's column offsets; each neuron's entries in chunks of `chunk` (a device
    # scalar: wg_chunk_over_mean mean lists, at least wg_chunk), their offsets and total
    floor_ = max(1, p.wg_chunk)
    off, coff = torch.empty((2, n), dtype=i32, device=dev).unbind(0)
    ctot, chunk = torch.empty((2,), dtype=i32, device=dev).split(1)
    if n:
        launch(wgrad_plan_kernel, (1,), (hist, off, coff, ctot, chunk, n, floor_, p.wg_chunk_over_mean),
               dict(B=min(1024, pow2(n))), num_warps=4)
    order = torch.empty((max(m * width, 1),), dtype=i32, device=dev)
    if m:
        launch(scatter_kernel, (m,), (cols, rk, q, off, order, width), dict(WP=pow2(width)), num_warps=1)
    # the backup rows' parts: cuBLAS on the gathered x / dy rows (zero rows for padding slots),
    # fp32, written into the outputs that wgrad_kernel then completes in place
    dwg = _mm_f32(sg.t(), xb)
    dwu = _mm_f32(su.t(), xb) if gated else None
    dwdt = _mm_f32(sh.t(), dyb)
    del xb, dyb
    st = SparseBwd(m=m, k=k, n=n, k_out=k_out, dt=dt, gated=gated, b_gate=b_gate, b_up=b_up, dx=dx, eg=eg,
                   eu=eu, q=q, cols=cols, width=width, w_gate=w_gate, wu=wu, sg=sg, su=su, dwg=dwg, dwu=dwu,
                   dwdt=dwdt, db=db, p=p)
    if n:
        # chunk -> neuron, persistent programs taking chunks from a ticket per pass and K chunk
        # (deterministic mode never gets here: select.plan_train runs eager's path there)
        bound = n + -(-(m * width) // floor_)         # chunks: at most N + entries / chunk
        nid = torch.empty((bound,), dtype=i32, device=dev)
        launch(chunk_map_kernel, (n,), (coff, ctot, nid, n), dict(BJ=32), num_warps=1)
        st.programs = min(bound, sm_count(dev) * p.wg_programs_per_sm)
        st.bkw = bkw
        st.tickets = tickets
        # wgrad_kernel's constexprs in signature order, DY, BKW and E filled in per pass
        st.consts = lambda dy, bk, e: dict(  # noqa: E731
            GATED=gated, HAS_BG=b_gate is not None, HAS_BU=b_up is not None, L1=bool(l1c),
            L1_DEV=l1_coef is not None, DY=dy, BKW=bk, E=e, ACT=ACTS.index(act), WP=pow2(width))
        # wgrad_kernel's arguments on either side of its ticket
        st.head = (order, off, hist, nid, coff, ctot)
        st.tail = (chunk, width, ell_g, ell_u if gated else ell_g, eg, eu, x2, x2.stride(0),
                   dy2, dy2.stride(0), mlist, mctr, w_gate, w_gate.stride(0),
                   b_gate if b_gate is not None else w_gate, wu, wu.stride(0),
                   b_up if b_up is not None else w_gate, wdt, wdt.stride(0), float(l1c),
                   l1_coef if l1_coef is not None else hist,
                   dwg, dwu if gated else dwg, dwdt, db[0], db[1], k, k_out)
    return st


def sparse_bwd_dy_pass(st: SparseBwd) -> None:
    """``wgrad_kernel`` DY pass (one launch, persistent programs over the neurons' chunks, dy
    rows gathered): dh, d_g and d_u at each slot (kept for dx and the X pass), dW_d^T[n] and the
    bias sums. It takes its chunks from st.tickets[0] (zeroed by the setup: a repeat needs it
    zeroed again, else it finds no chunk left)."""
    if st.n:
        warps = warps_by_width(st.k_out, st.p.wg_dy_cols_per_warp)
        launch(wgrad_kernel, (st.programs, 1), (*st.head, st.tickets[:1], *st.tail),    # whole dy rows for dh
               st.consts(True, pow2(st.k_out), st.p.wg_dy_entries), num_warps=warps, maxnreg=st.p.wg_dy_maxnreg)


def sparse_bwd_x_pass(st: SparseBwd) -> None:
    """``wgrad_kernel`` X pass (one launch, a program column per K chunk, x rows gathered):
    dW_g[n] and dW_u[n] from the DY pass's d_g, d_u. Tickets st.tickets[1:], as the DY pass's."""
    if st.n:
        launch(wgrad_kernel, (st.programs, -(-st.k // st.bkw)), (*st.head, st.tickets[1:], *st.tail),
               st.consts(False, st.bkw, st.p.wg_x_entries), num_warps=st.p.wg_x_warps, maxnreg=st.p.wg_x_maxnreg)


def sparse_bwd_dx(st: SparseBwd) -> None:
    """``dx_rows_kernel`` (one launch): the quiet rows' dx from the W_g and W_u rows of their
    slots (the busy rows' dx came from train_bwd_kernel in the setup)."""
    if st.m:
        launch(dx_rows_kernel, (st.m,), (st.q, st.cols, st.eg, st.eu, st.width, st.w_gate, st.w_gate.stride(0),
                                         st.wu, st.wu.stride(0), st.dx, st.dx.stride(0), st.k),
               dict(GATED=st.gated, K_P=pow2(st.k), PAIRS=st.p.dx_pairs), num_warps=_warps(st.k, st.k))


def sparse_bwd_outputs(st: SparseBwd):
    """(dx, dW_g, db_g, dW_u, db_u, dW_d): the fp32 weight gradients cast to the dtype, the bias
    sums completed with the backup rows'."""
    dt = st.dt
    dwg = st.dwg.to(dt)
    dwu = st.dwu.to(dt) if st.gated else None
    dwdt = st.dwdt.to(dt)
    db_gate = (st.db[0] + st.sg.float().sum(0)).to(dt) if st.b_gate is not None else None
    db_up = (st.db[1] + st.su.float().sum(0)).to(dt) if (st.gated and st.b_up is not None) else None
    return st.dx, dwg, db_gate, dwu, db_up, transposed(dwdt)


def backward_sparse(dy2, x2, w_gate, b_gate, w_up, b_up, w_down, cnt, cols, ell_g, ell_u,
                    bidx, bg, bu, l1c, act="relu", l1_coef=None):
    """(dx, dW_g, db_g, dW_u, db_u, dW_d): ranks and the busy rows, counting sort, the
    per-neuron DY pass (dh, d_g, d_u, dW_d, bias grads), the per-neuron X pass (dW_g, dW_u),
    then dx of the quiet rows. Each gathering pass reads rows of one tensor only (dy; x;
    W_g and W_u), so its working set is about the L2's size. Stage by stage: sparse_bwd_setup,
    sparse_bwd_dy_pass, sparse_bwd_x_pass, sparse_bwd_dx, sparse_bwd_outputs."""
    st = sparse_bwd_setup(dy2, x2, w_gate, b_gate, w_up, b_up, w_down, cnt, cols, ell_g, ell_u,
                          bidx, bg, bu, l1c, act, l1_coef)
    sparse_bwd_dy_pass(st)
    sparse_bwd_x_pass(st)
    sparse_bwd_dx(st)
    return sparse_bwd_outputs(st)


def backward_dense(dy2, x2, w_gate, b_gate, w_up, b_up, w_down, g, u, l1c, act="relu", l1_coef=None):
    """Eager's backward from the saved g [M, N] and u (None when non-gated). Three [M, N]
    buffers (dh, later h; dg; du) beside the saved two; h goes once dW_d has it, before dx and
    the other weight grads are allocated (with h kept to the end the extra peak exceeded
    eager's: docs/design-notes/training.md)."""
    gated = w_up is not None
    g = g.contiguous()
    u = u.contiguous() if gated else None
    h = dy2.mm(w_down)                                  # dh; the kernel leaves h in its place
    dg = torch.empty_like(g)
    du = torch.empty_like(u) if gated else None
    m, n = g.shape
    bias = b_gate is not None or (gated and b_up is not None)
    db = torch.zeros((2, n), dtype=torch.float32, device=g.device) if bias else None
    if g.numel():
        launch(train_dense_bwd_kernel, (-(-m // EW_BM), -(-n // EW_BN)),
               (g, u if gated else g, h, dg, du if gated else dg, db if bias else g, m, n, float(l1c),
                l1_coef if l1_coef is not None else g),
               dict(GATED=gated, L1=bool(l1c), L1_DEV=l1_coef is not None, BIAS=bias, BM=EW_BM, BN=EW_BN,
                    ACT=ACTS.index(act)), num_warps=4)
    dw_down = dy2.t().mm(h)
    del h
    dx, dw_gate, db_gate, dw_up, db_up = _products(x2, w_gate, None, w_up, None, dg, du)
    if bias:
        db_gate = db[0].to(g.dtype) if b_gate is not None else None
        db_up = db[1].to(g.dtype) if (gated and b_up is not None) else None
    return dx, dw_gate, db_gate, dw_up, db_up, dw_down


def _products(x2, w_gate, b_gate, w_up, b_up, dg, du):
    """(dx, dW_g, db_g, dW_u, db_u) from dense d_g, d_u [M, N] (d_u None when non-gated): four
    cuBLAS products, called once h is freed so dx and the weight grads do not add to its peak."""
    dx = dg.mm(w_gate)
    if du is not None:
        dx.addmm_(du, w_up)
    dw_gate = dg.t().mm(x2)
    db_gate = dg.sum(0) if b_gate is not None else None
    dw_up = du.t().mm(x2) if du is not None else None
    db_up = du.sum(0) if (du is not None and b_up is not None) else None
    return dx, dw_gate, db_gate, dw_up, db_up


def _mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with an fp32 result from bf16/fp16 operands (cuBLAS accumulates in fp32 either way)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float().mm(b.float())


def backup_slots(bidx: Tensor, m: int, x2: Optional[Tensor] = None,
                 dy2: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """(slot_of, xb, dyb) by ``backup_rows_kernel`` (one launch): slot_of [M + 1] int32, each
    row's dense-backup slot (-1 for rows without one; entry M unused); with ``x2`` and ``dy2``
    the slots' x and dy rows [C, K], [C, K_out] (zero rows for padding slots, backup_idx -1),
    else None for both."""
    rows = x2 is not None
    slot_of = torch.full((m + 1,), -1, dtype=torch.int32, device=bidx.device)
    cap = bidx.shape[0]
    xb = x2.new_empty((cap, x2.shape[1])) if rows else None
    dyb = x2.new_empty((cap, dy2.shape[1])) if rows else None     # (in x's dtype, as the products take it)
    if cap:
        # (without rows the copies are compiled out: slot_of stands in for their pointers)
        x, dy, k, k_out = (x2, dy2, x2.shape[1], dy2.shape[1]) if rows else (slot_of, slot_of, 0, 0)
        launch(backup_rows_kernel, (cap,), (bidx, slot_of, x, x.stride(0), dy, dy.stride(0),
                                            xb if rows else slot_of, dyb if rows else slot_of, k, k_out),
               dict(BK=min(1024, pow2(max(k, k_out, 1))), ROWS=rows), num_warps=4)
    return slot_of, xb, dyb


def backward_densify(dy2, x2, w_gate, b_gate, w_up, b_up, w_down, cnt, cols, ell_g, ell_u,
                     bidx, bg, bu, l1c, act="relu", l1_coef=None):
    """Eager's GEMMs from the compact state: dh = dy W_d, then ``train_densify_kernel`` writes
    d_g, d_u and h whole from the ELL slots and backup rows (rows past the backup recomputed),
    then the five products as ``backward_densify``."""

    m, k = x2.shape
    n = w_gate.shape[0]
    gated = w_up is not None
    width = cols.shape[1]
    slot_of = backup_slots(bidx, m)[0]
    h = dy2.mm(w_down)                                  # dh; the kernel leaves h in its place
    dg = torch.empty_like(h)
    du = torch.empty_like(h) if gated else None
    wg = unit_rows(w_gate)
    wu = unit_rows(w_up) if gated else wg
    if m and n:
        launch(train_densify_kernel, (m,), (
            h, dg, du if gated else dg, cnt, cols, ell_g, ell_u if gated else ell_g, width,
            slot_of, bg, bu if gated else bg, x2, x2.stride(0), wg, wg.stride(0),
            b_gate if b_gate is not None else wg, wu, wu.stride(0),
            b_up if b_up is not None else wg, n, k, float(l1c), l1_coef if l1_coef is not None else cnt),
            dict(GATED=gated, HAS_BG=b_gate is not None, HAS_BU=b_up is not None, L1=bool(l1c),
                 L1_DEV=l1_coef is not None, W_P=pow2(max(width, 1)), K_P=pow2(k), CH=min(CH, pow2(n)), BK=RBK,
                 DCH=min(DENSIFY_CH, pow2(n)), ACT=ACTS.index(act)), num_warps=4)
    dw_down = dy2.t().mm(h)
    del h
    return (*_products(x2, w_gate, b_gate, w_up, b_up, dg, du), dw_down)


def backward_path(backup_idx: Tensor, m: int) -> str:
    """The backward a saved state of ``m`` tokens takes: "dense" for a backup of at least M
    rows (the dense forward's g and u), else a compact state: the backward its forward marked
    it with (``mark_backward``), "sparse" where unmarked."""
    if backup_idx.shape[0] >= m:
        return "dense"
    return getattr(backup_idx, BACKWARD, "sparse")


def ffn_train_backward(dy: Tensor, x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor],
                       w_up: Optional[Tensor], b_up: Optional[Tensor], w_down: Tensor,
                       counts: Tensor, cols: Tensor, ell_g: Tensor, ell_u: Tensor,
                       backup_idx: Tensor, backup_g: Tensor, backup_u: Tensor, l1_scale: float,
                       act: str = "relu", l1_coef: Optional[Tensor] = None, db_down: bool = True):
    """``l1_scale`` / (M N) goes to the kernels as a float; ``l1_coef`` (the controller's [1]
    fp32 coefficient, or None) multiplies it on the device (L1_DEV). ``db_down`` False: no sum
    of dy (a pass over [M, K_out]), db_down None."""
    k, n, k_out = x.shape[-1], w_gate.shape[0], w_down.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    dy2 = dy.reshape(-1, k_out)
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    m = x2.shape[0]
    l1c = l1_scale / max(m * n, 1) if l1_scale else 0.0
    path = backward_path(backup_idx, m)
    if path != "dense":
        out = (backward_densify if path == "densify" else backward_sparse)(
            dy2, x2, w_gate, b_gate, w_up, b_up, w_down, counts, cols, ell_g, ell_u,
            backup_idx, backup_g, backup_u, l1c, act, l1_coef if l1c else None)
    else:
        if backup_idx.shape[0] != m:
            raise ValueError(f"backup_idx: {backup_idx.shape[0]} rows saved for {m} tokens; the "
                             "CUDA dense forward saves exactly M, the sparse one fewer")
        out = backward_dense(dy2, x2, w_gate, b_gate, w_up, b_up, w_down, backup_g,
                             backup_u if w_up is not None else None, l1c, act, l1_coef if l1c else None)
    dx, dw_gate, db_gate, dw_up, db_up, dw_down = out
    return dx.reshape(x.shape), dw_gate, db_gate, dw_up, db_up, dw_down, dy2.sum(0) if db_down else None
