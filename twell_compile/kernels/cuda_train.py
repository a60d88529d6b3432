"""CUDA training FFN (twell::ffn_train / ffn_train_bwd), bf16/fp16: sparse or dense per call,
no host sync. The sparse forward saves the compact hybrid state (formats.Hybrid); the dense
forward saves either the same compact state or g and u whole, as a backup of all M rows
(backup_idx = 0..M-1; the ELL part unwritten). The backward reads g-and-u from the backup's
row count (M; a compact state needs cap < M), and densify-or-sparse for a compact state from
a hint keyed on its backup_idx (both exact on any compact state).

Sparse forward, for x [M, K]:
  1. cuBLAS gate GEMM g = x W_g^T + b_g, then ``compact_rows_kernel`` (twell_rows.py): the
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
u) while the layer's last measurement lost no rows past the backup (COMPACT_MAX_LOST), else
g and u. Backward from g and u: dh = dy W_d, one elementwise pass (twell_train_dense.py), five
more cuBLAS products; from the compact state (``backward_densify``): dh = dy W_d,
``train_densify_kernel`` (twell_train_densify.py) writing d_g, d_u and h whole, the same five
products. Eager's nine GEMMs either way. (Until session 7 the dense backward recomputed g and
u: eleven GEMMs, 0.69-0.82x of eager.)

Choice: bf16/fp16 within cuda_policy's widths (``supports``), M >= MIN_TOKENS, and the layer's
lagged density (cuda_policy's sync-free probes, under a "train" key) against
SPARSE_MAX_DENSITY; a second key ("train-lost") carries the rows lost past the backup. Inside
a backward pass (activation checkpointing's recompute) the policy
is not polled, so the recompute takes the path its forward took and saves tensors of the same
shapes (non-reentrant checkpointing checks them).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from twell_compile import stats
from twell_compile.kernels import cuda_policy
from twell_compile.kernels.cuda_infer import (COMPACT_BM, COMPACT_CH, COMPACT_WARPS, _INTERPRET, _pow2, _rows,
                                             _transposed, warps_by_width)
from twell_compile.kernels.torch_impl import backup_capacity

# Sparse while the layer's measured density is under this. H200, M=16384, K=2048, N=5632
# (run 9, benchmarks/results/h200/train_run9/): sparse 3.29 ms at 28 non-zeros/row, 5.34 at
# 50 (tail 0.2, 1.7% busy rows), 8.83 at 115; the dense path 6.2-6.4 ms: crossover near
# 75 non-zeros/row (0.013); 0.011 keeps a margin. (Run 2's kernels: 0.0085.) Run 15's dense
# path saves g and u: 4.9-5.0 ms, which moves the crossover to ~58 non-zeros/row (0.010) at
# M=16384 (tail 0.2 at 50: sparse 5.13 vs dense 4.95) but not at M=65536 (19.2 vs 20.8-22.4):
# not retuned; 0.011 costs <= 5% in that band at 16k tokens.
SPARSE_MAX_DENSITY = 0.011
# Both paths have the per-row counts, so a probe is one sum and an async copy: every call.
# Training moves densities fast (bench_e2e --train, lr 3e-4, no L1: 0.006 -> 0.016-0.027
# in 20 steps), and at 16 calls between probes a layer ran sparse at 0.017 (8.8 ms vs 6.3).
PROBE_EVERY = 1
# A row past the dense backup is recomputed per neuron in the backward: ~55 us each (run 9,
# d=0.02 tail 0.2: ~1600 such rows, 95 ms) against ~3.9 ns per listed (row, neuron) pair
# (slope of run 9's sparse times). The probe counts each such row as this many pairs, so
# a layer with rows past the backup turns dense as its cost says, not as its density does.
LOST_ROW_PAIRS = 14000
MIN_TOKENS = 8192  # the inference rule's; at 1024 tokens both paths trail eager (launch-bound)
PAIRS = 4
CH = 256          # columns per scan step over g / backup rows
RBK = 64          # K per recompute step in the backward (CH columns x RBK)
FWD_WARPS = 0     # train_fwd_kernel: 0: pow2(max(K, K_out)) / FWD_COLS_PER_WARP warps
FWD_COLS_PER_WARP = 1024    # H200 M=16384 K=2048 d=0.005 (session 15 run 3, probe_rows.py):
FWD_PAIRS = 1               # 1 pair / 2 warps 531 us, 4 / 4 682, 1 / 4 566, 2 / 4 705
# the same kernel writing the state only (Y=False: the dense path's compact state, u read from
# the dense u, no weight rows): its per-pair work is a few loads and stores, so more pairs per
# step; session 14's 4 pairs / 4 warps (1 / 2 made bench_e2e --train's dense steps 280 vs 243 ms)
STATE_PAIRS = 4
STATE_COLS_PER_WARP = 512
BWD_WARPS = 0
# Per-neuron weight-gradient passes (twell_train_wgrad.py), per pass: entries (gathered rows)
# per step, warps; the X pass takes K in chunks of WG_BK columns, the DY pass whole rows of
# K_out. Session 14's 4 entries / 4 warps in both passes: on the synthetic layer (M=16384
# d=0.005, no bias, no penalty; session 15 run 2, probe_wgrad.py) DY 1 entry / 2 warps ran 460
# us against 636 and X 2 / 2 391 against 437, but on bench_e2e --train (biases, twell.l1=12)
# those configs made the step 214.8 ms against 197.7 (run 16, same run, everything else equal),
# so the whole model keeps these. Loading the next entries one step ahead: no gain (run 1).
WG_DY_ENTRIES = 4
WG_DY_COLS_PER_WARP = 512    # DY warps = pow2(K_out) / this, at least 1
WG_X_ENTRIES = 4
WG_X_WARPS = 4
WG_BK = 2048
DX_PAIRS = 4      # slots per step of dx_rows_kernel
RANK_BM, RANK_BP = 8, 32    # rank_kernel: rows per program, slots per step
BUSY_PROGRAMS = 1024        # the busy-row kernel's fixed grid (it strides over the busy rows)
DX_WARPS = 0      # 0: 4 warps for K <= 2048, else 8
EW_BLOCK = 4096
DENSIFY_CH = 2048   # columns per streamed step of train_densify_kernel (16 per thread at 4 warps)

# Dense layers save the compact hybrid state (not g and u) while their last measurement lost
# at most this many rows past the backup (rows that backward_densify recomputes one by one
# from x on CUDA cores; not timed, the sparse path's per-neuron recompute took ~55 us per
# row): sparse-path memory at dense speed (run 19: 0.99-1.00x of eager at 69% of its extra
# peak, d=0.02). -1: always g and u; inf: always compact.
COMPACT_MAX_LOST = 0

# The path each layer's last forward took, by policy key: for benchmarks and tests to report
# (the backward reads its path from the saved shapes, never from here).
last_sparse: dict[tuple, bool] = {}
# A compact state's backward: densify (the forward ran dense) or sparse, by the saved
# backup_idx's address. Only a speed hint: both backward paths are exact for any hybrid state,
# and a miss (an address reused, a table overflow) takes the sparse one.
_densify: "OrderedDict[int, bool]" = OrderedDict()
_MAX_HINTS = 4096


def _densify_hint(bidx: Tensor, densify: bool) -> None:
    if bidx.numel():
        _densify[bidx.data_ptr()] = densify
        _densify.move_to_end(bidx.data_ptr())
        while len(_densify) > _MAX_HINTS:
            _densify.popitem(last=False)


def supports(x: Tensor, w_gate: Tensor, w_down: Tensor) -> bool:
    """bf16/fp16 CUDA tensors within the kernels' widths (fp32 stays on torch_impl)."""
    n, k, k_out = w_gate.shape[0], x.shape[-1], w_down.shape[0]
    return (x.is_cuda and x.dtype in cuda_policy.DTYPES and k <= cuda_policy.MAX_WIDTH
            and k_out <= cuda_policy.MAX_WIDTH and 1 <= n <= cuda_policy.MAX_N)


def _warps(k: int, k_out: int, fixed: int) -> int:
    return fixed or (8 if _pow2(max(k, k_out)) > 2048 else 4)


def _state(x2: Tensor, g: Tensor, u: Optional[Tensor], w_up: Optional[Tensor], b_up: Optional[Tensor],
           w_down: Tensor, b_down: Optional[Tensor], width: int, cap: int, compute_y: bool):
    """Compaction + train_fwd_kernel. Returns (y or None, hsum or None, counts, cols, ell_g,
    ell_u, backup_idx, backup_g, backup_u, missing rows [0-d])."""
    from twell_compile.kernels.twell_rows import compact_rows_kernel
    from twell_compile.kernels.twell_train_fwd import train_fwd_kernel

    m, k = x2.shape
    n, k_out = g.shape[1], w_down.shape[0]
    dev, dt = x2.device, x2.dtype
    gated = w_up is not None
    lst = torch.empty((m, width), dtype=torch.int32, device=dev)
    cnt = torch.empty((m,), dtype=torch.int32, device=dev)
    cols = torch.zeros((m, width), dtype=torch.int32, device=dev)
    ell_g = torch.zeros((m, width), dtype=dt, device=dev)
    ell_u = torch.zeros((m, width if gated else 0), dtype=dt, device=dev)
    bidx = torch.full((cap,), -1, dtype=torch.int64, device=dev)
    bg = torch.zeros((cap, n), dtype=dt, device=dev)
    bu = torch.zeros((cap, n if gated else 0), dtype=dt, device=dev)
    ctr = torch.zeros((3,), dtype=torch.int32, device=dev)     # backup slots; the order's two
    order = torch.empty((m,), dtype=torch.int32, device=dev)
    y = torch.empty((m, k_out), dtype=dt, device=dev) if compute_y else None
    hsum = torch.empty((m,), dtype=torch.float32, device=dev) if compute_y else None
    if m:
        compact_rows_kernel[(-(-m // COMPACT_BM),)](
            g, g.stride(0), lst, cnt, order, ctr[1:], m, n, width,
            BM=COMPACT_BM, CH=min(COMPACT_CH, _pow2(n)), ASM=not _INTERPRET, num_warps=COMPACT_WARPS)
        wdt = _transposed(w_down) if compute_y else g
        wu = w_up if (compute_y and gated) else g
        pairs, cpw = (FWD_PAIRS, FWD_COLS_PER_WARP) if compute_y else (STATE_PAIRS, STATE_COLS_PER_WARP)
        train_fwd_kernel[(m,)](
            x2, x2.stride(0), g, g.stride(0), lst, cnt, order,
            u if u is not None else g, u.stride(0) if u is not None else 0,
            wu, wu.stride(0), b_up if b_up is not None else g,
            wdt, wdt.stride(0), b_down if b_down is not None else g,
            y if y is not None else g, y.stride(0) if y is not None else 0,
            hsum if hsum is not None else cnt,
            cols, ell_g, ell_u, bidx, bg, bu, ctr,
            k, n, k_out, width, cap,
            GATED=gated, HAS_BU=b_up is not None, HAS_BD=b_down is not None, Y=compute_y,
            K_P=_pow2(k), KO_P=_pow2(k_out), PAIRS=pairs, CH=min(CH, _pow2(n)),
            num_warps=FWD_WARPS or warps_by_width(max(k, k_out), cpw))
    missing = (ctr[0] - cap).clamp(min=0)
    return y, hsum, cnt, cols, ell_g, ell_u, bidx, bg, bu, missing


def forward_sparse(x2, w_gate, b_gate, w_up, b_up, w_down, b_down, width, cap):
    w_up = None if w_up is None else _rows(w_up)
    g = F.linear(x2, w_gate, b_gate)
    return _state(x2, g, None, w_up, b_up, w_down, b_down, width, cap, True)


def forward_dense(x2, w_gate, b_gate, w_up, b_up, w_down, b_down, width, cap, compact=False,
                  count_lost=True):
    """cuBLAS forward, bit-identical to eager: (y, sum |h| per row [M] fp32, state). The state
    is (counts, cols, ell_g, ell_u, backup_idx, backup_g, backup_u, missing [0-d]) with g and u
    as a backup of all M rows; cols and the ELL values are left unwritten (the dense backward
    reads g and u only). relu(g)*u is the inference dense path's pass, which also counts
    non-zeros and sums |h| per row (the probe and the statistics). ``missing`` is the rows the
    sparse path could not have kept (rows over ``width`` past a backup of ``cap``), so the
    policy's lost-row penalty sees them from dense calls too: without it a layer flipped back
    to sparse every other call (run 12). ``count_lost=False`` (no probe this call): None, and
    three small launches fewer.

    ``compact``: save the hybrid state instead (the compaction and ``train_fwd_kernel`` with
    Y=False over g and u, as before session 7): a sparse path's memory at dense speed, its
    backward ``backward_densify``; taken while the layer's last measurement lost no rows."""
    from twell_compile.kernels.cuda_infer import relu_mul_rows

    m = x2.shape[0]
    n, dev, dt = w_gate.shape[0], x2.device, x2.dtype
    g = F.linear(x2, w_gate, b_gate)
    u = None if w_up is None else F.linear(x2, w_up, b_up)
    h, cnt, hsum = relu_mul_rows(g, u)
    y = F.linear(h, w_down, b_down)
    del h
    if compact:
        _, _, *state = _state(x2, g, u, w_up, b_up, w_down, b_down, width, cap, False)
        return y, hsum, tuple(state)
    cols = torch.empty((m, width), dtype=torch.int32, device=dev)
    ell_g = torch.empty((m, width), dtype=dt, device=dev)
    ell_u = torch.empty((m, width if u is not None else 0), dtype=dt, device=dev)
    bidx = torch.arange(m, dtype=torch.int64, device=dev)
    bu = u if u is not None else g.new_empty((m, 0))
    missing = ((cnt > width).sum(dtype=torch.int32) - cap).clamp(min=0) if count_lost else None
    return y, hsum, (cnt, cols, ell_g, ell_u, bidx, g, bu, missing)


def ffn_train_forward(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                      b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
                      ell_width: int, backup_rows: int, layer: str, keep_stats: bool) -> tuple[Tensor, ...]:
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n, k_out = x2.shape[0], w_gate.shape[0], w_down.shape[0]
    width = min(ell_width, n)
    cap = int(backup_capacity(m, backup_rows))
    gated = w_up is not None
    key = ("train", layer, x.device, x.dtype, k, n, k_out, gated)
    lkey = ("train-lost",) + key[1:]                    # rows past the backup, per call
    sparse = compact = probe = False
    # torch.use_deterministic_algorithms: eager's path (saving g and u), since the sparse and
    # compact states are built with atomic slot and rank counters
    if m >= MIN_TOKENS and cap < m and not torch.are_deterministic_algorithms_enabled():
        if torch._C._current_graph_task_id() == -1:     # not in a backward (checkpoint recompute)
            cuda_policy.poll(key)                       # the lagged measurements
            cuda_policy.poll(lkey)
        d = cuda_policy.density(key)
        sparse = d is not None and d < SPARSE_MAX_DENSITY
        lost = cuda_policy.density(lkey)
        compact = not sparse and lost is not None and lost <= COMPACT_MAX_LOST
        probe = cuda_policy.wants_probe(key, sparse, every=PROBE_EVERY)
    if sparse:
        y, hsum, cnt, *rest = forward_sparse(x2, w_gate, b_gate, w_up, b_up, w_down, b_down, width, cap)
        missing = rest[-1]
        if keep_stats:
            stats.record(layer, cnt, hsum.sum(), missing, n)
    else:
        y, hsum, (cnt, *rest) = forward_dense(x2, w_gate, b_gate, w_up, b_up, w_down, b_down,
                                              width, cap, compact, count_lost=probe)
        missing = rest[-1]                 # lost rows (compact) or what sparse would lose
        if keep_stats:
            stats.record(layer, cnt, hsum.sum(), missing if compact else cnt.new_zeros(()), n)
    if probe:
        cuda_policy.submit(key, cnt.sum() + missing * LOST_ROW_PAIRS, m * n)
        cuda_policy.submit(lkey, missing, 1)
    if sparse or compact:                  # a compact state: tell its backward which way
        _densify_hint(rest[3], compact)
    if m >= MIN_TOKENS and cap < m:
        cuda_policy.tick(key)
    last_sparse[key] = sparse
    return (y.reshape(*x.shape[:-1], k_out), cnt, *rest[:-1])


def backward_sparse(dy2, x2, w_gate, b_gate, w_up, b_up, w_down, cnt, cols, ell_g, ell_u,
                    bidx, bg, bu, l1c):
    """(dx, dW_g, db_g, dW_u, db_u, dW_d): ranks and the busy rows, counting sort, the
    per-neuron DY pass (dh, d_g, d_u, dW_d, bias grads), the per-neuron X pass (dW_g, dW_u),
    then dx of the quiet rows. Each gathering pass reads rows of one tensor only (dy; x;
    W_g and W_u), so its working set is about the L2's size."""
    from twell_compile.kernels.twell_train_bwd import dx_rows_kernel, rank_kernel, train_bwd_kernel
    from twell_compile.kernels.twell_train_wgrad import scatter_kernel, wgrad_kernel

    m, k = x2.shape
    n, k_out = w_gate.shape[0], w_down.shape[0]
    width = cols.shape[1]
    dev, dt = x2.device, x2.dtype
    gated = w_up is not None
    cap = bidx.shape[0]
    f32, i32 = torch.float32, torch.int32
    slot_of = _slot_of(bidx, m)
    dx = torch.empty((m, k), dtype=dt, device=dev)
    # quiet rows: ranks in their columns, per-column counts; d_g, d_u per slot (fp32)
    rk = torch.empty((m, width), dtype=i32, device=dev)
    q = torch.empty((m,), dtype=i32, device=dev)
    hist = torch.zeros((n,), dtype=i32, device=dev)
    eg = torch.empty((m, width), dtype=f32, device=dev)
    eu = torch.empty((m, width), dtype=f32, device=dev) if gated else eg
    # backup rows: dense [C, N]; rows past it: listed for the per-neuron recompute
    sg = torch.zeros((cap, n), dtype=dt, device=dev)
    su = torch.zeros((cap, n), dtype=dt, device=dev) if gated else sg
    sh = torch.zeros((cap, n), dtype=dt, device=dev)
    mlist = torch.empty((max(m, 1),), dtype=i32, device=dev)
    mctr = torch.zeros((1,), dtype=i32, device=dev)
    w_gate = _rows(w_gate)
    wu = _rows(w_up) if gated else w_gate
    wdt = _transposed(w_down)
    blist = torch.empty((max(m, 1),), dtype=i32, device=dev)
    bctr = torch.zeros((1,), dtype=i32, device=dev)
    if m:
        rank_kernel[(-(-m // RANK_BM),)](
            x2, x2.stride(0), dy2, dy2.stride(0), cnt, cols, width, q, rk, hist, blist, bctr, m, k, k_out,
            BM=RANK_BM, BK=min(256, _pow2(max(k, k_out))), BP=RANK_BP, num_warps=4)
        train_bwd_kernel[(min(m, BUSY_PROGRAMS),)](
            dy2, dy2.stride(0), x2, x2.stride(0), blist, bctr,
            slot_of, bg, bu if gated else bg,
            w_gate, w_gate.stride(0), b_gate if b_gate is not None else w_gate,
            wu, wu.stride(0), b_up if b_up is not None else w_gate, wdt, wdt.stride(0),
            dx, dx.stride(0), sg, su, sh, mlist, mctr,
            k, n, k_out, float(l1c),
            GATED=gated, HAS_BG=b_gate is not None, HAS_BU=b_up is not None, L1=bool(l1c),
            K_P=_pow2(k), KO_P=_pow2(k_out), PAIRS=PAIRS, CH=min(CH, _pow2(n)),
            BK=RBK, num_warps=_warps(k, k_out, BWD_WARPS))
    off = torch.cumsum(hist, 0, dtype=i32) - hist
    order = torch.empty((max(m * width, 1),), dtype=i32, device=dev)
    if m:
        scatter_kernel[(m,)](cols, rk, q, off, order, width, WP=_pow2(width), num_warps=1)
    # the backup rows' parts: cuBLAS on the gathered x / dy rows (padding slots: zero rows),
    # written into the outputs that wgrad_kernel then completes in place
    valid = (bidx >= 0).unsqueeze(1)
    rows = bidx.clamp(min=0)
    if m:
        xb = torch.where(valid, x2[rows], torch.zeros((), dtype=dt, device=dev))
        dyb = torch.where(valid, dy2[rows], torch.zeros((), dtype=dt, device=dev))
    else:                                   # no rows (the op's M = 0 runs dense): all padding
        xb, dyb = x2.new_zeros((cap, k)), dy2.new_zeros((cap, k_out))
    dwg = sg.t().mm(xb)
    dwu = su.t().mm(xb) if gated else None
    dwdt = sh.t().mm(dyb)
    del xb, dyb
    db = torch.empty((2, n), dtype=f32, device=dev)
    common = dict(GATED=gated, HAS_BG=b_gate is not None, HAS_BU=b_up is not None, L1=bool(l1c))
    args = (order, off, hist, width, ell_g, ell_u if gated else ell_g, eg, eu, x2, x2.stride(0),
            dy2, dy2.stride(0), mlist, mctr, w_gate, w_gate.stride(0),
            b_gate if b_gate is not None else w_gate, wu, wu.stride(0),
            b_up if b_up is not None else w_gate, wdt, wdt.stride(0), float(l1c),
            dwg, dwu if gated else dwg, dwdt, db[0], db[1], k, k_out)
    bk_dy = _pow2(k_out)                       # the DY pass needs whole dy rows for dh
    wgrad_kernel[(n, 1)](*args, DY=True, BKW=bk_dy, E=WG_DY_ENTRIES,
                         num_warps=warps_by_width(k_out, WG_DY_COLS_PER_WARP), **common)
    bkw = min(WG_BK, _pow2(k))
    wgrad_kernel[(n, -(-k // bkw))](*args, DY=False, BKW=bkw, E=WG_X_ENTRIES, num_warps=WG_X_WARPS, **common)
    if m:
        dx_rows_kernel[(m,)](q, cols, eg, eu, width, w_gate, w_gate.stride(0), wu, wu.stride(0),
                             dx, dx.stride(0), k, GATED=gated, K_P=_pow2(k), PAIRS=DX_PAIRS,
                             num_warps=_warps(k, k, DX_WARPS))
    db_gate = (db[0] + sg.float().sum(0)).to(dt) if b_gate is not None else None
    db_up = (db[1] + su.float().sum(0)).to(dt) if (gated and b_up is not None) else None
    return dx, dwg, db_gate, dwu, db_up, _transposed(dwdt)


def backward_dense(dy2, x2, w_gate, b_gate, w_up, b_up, w_down, g, u, l1c):
    """Eager's backward from the saved g [M, N] and u (None when non-gated). Three [M, N]
    buffers (dh, later h; dg; du) beside the saved two; h goes once dW_d has it, before dx and
    the other weight grads are allocated (run 14: 1106 MiB extra peak at M=16384 d=0.02 with
    h kept to the end, eager 966)."""
    from twell_compile.kernels.twell_train_dense import train_dense_bwd_kernel

    gated = w_up is not None
    h = dy2.mm(w_down)                                  # dh; the kernel leaves h in its place
    dg = torch.empty_like(g)
    du = torch.empty_like(u) if gated else None
    numel = g.numel()
    if numel:
        train_dense_bwd_kernel[(-(-numel // EW_BLOCK),)](
            g, u if gated else g, h, dg, du if gated else dg, numel, float(l1c),
            GATED=gated, L1=bool(l1c), BLOCK=EW_BLOCK, num_warps=8)
    dw_down = dy2.t().mm(h)
    del h
    return (*_products(x2, w_gate, b_gate, w_up, b_up, dg, du), dw_down)


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


def _slot_of(bidx: Tensor, m: int) -> Tensor:
    """[M + 1] int32: each row's dense-backup slot, -1 for rows without one (padding slots,
    backup_idx -1, land on the extra entry M)."""
    slot_of = torch.full((m + 1,), -1, dtype=torch.int32, device=bidx.device)
    slot_of.scatter_(0, torch.where(bidx >= 0, bidx, m),
                     torch.arange(bidx.shape[0], dtype=torch.int32, device=bidx.device))
    return slot_of


def backward_densify(dy2, x2, w_gate, b_gate, w_up, b_up, w_down, cnt, cols, ell_g, ell_u,
                     bidx, bg, bu, l1c):
    """Eager's GEMMs from the compact state: dh = dy W_d, then ``train_densify_kernel`` writes
    d_g, d_u and h whole from the ELL slots and backup rows (rows past the backup recomputed),
    then the five products as ``backward_dense``."""
    from twell_compile.kernels.twell_train_densify import train_densify_kernel

    m, k = x2.shape
    n = w_gate.shape[0]
    gated = w_up is not None
    width = cols.shape[1]
    slot_of = _slot_of(bidx, m)
    h = dy2.mm(w_down)                                  # dh; the kernel leaves h in its place
    dg = torch.empty_like(h)
    du = torch.empty_like(h) if gated else None
    wg = _rows(w_gate)
    wu = _rows(w_up) if gated else wg
    if m and n:
        train_densify_kernel[(m,)](
            h, dg, du if gated else dg, cnt, cols, ell_g, ell_u if gated else ell_g, width,
            slot_of, bg, bu if gated else bg, x2, x2.stride(0), wg, wg.stride(0),
            b_gate if b_gate is not None else wg, wu, wu.stride(0),
            b_up if b_up is not None else wg, n, k, float(l1c),
            GATED=gated, HAS_BG=b_gate is not None, HAS_BU=b_up is not None, L1=bool(l1c),
            W_P=_pow2(max(width, 1)), K_P=_pow2(k), CH=min(CH, _pow2(n)), BK=RBK,
            DCH=min(DENSIFY_CH, _pow2(n)), num_warps=4)
    dw_down = dy2.t().mm(h)
    del h
    return (*_products(x2, w_gate, b_gate, w_up, b_up, dg, du), dw_down)


def ffn_train_backward(dy: Tensor, x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor],
                       w_up: Optional[Tensor], b_up: Optional[Tensor], w_down: Tensor,
                       counts: Tensor, cols: Tensor, ell_g: Tensor, ell_u: Tensor,
                       backup_idx: Tensor, backup_g: Tensor, backup_u: Tensor, l1_scale: float):
    k, n, k_out = x.shape[-1], w_gate.shape[0], w_down.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    dy2 = dy.reshape(-1, k_out)
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    m = x2.shape[0]
    l1c = l1_scale / max(m * n, 1) if l1_scale else 0.0
    if backup_idx.shape[0] < m:         # a compact state (it needs capacity < M)
        densify = backup_idx.numel() and _densify.pop(backup_idx.data_ptr(), False)
        out = (backward_densify if densify else backward_sparse)(
            dy2, x2, w_gate, b_gate, w_up, b_up, w_down, counts, cols, ell_g, ell_u,
            backup_idx, backup_g, backup_u, l1c)
    else:
        if backup_idx.shape[0] != m:
            raise ValueError(f"backup_idx: {backup_idx.shape[0]} rows saved for {m} tokens; the "
                             "CUDA dense forward saves exactly M, the sparse one fewer")
        out = backward_dense(dy2, x2, w_gate, b_gate, w_up, b_up, w_down, backup_g,
                             backup_u if w_up is not None else None, l1c)
    dx, dw_gate, db_gate, dw_up, db_up, dw_down = out
    return dx.reshape(x.shape), dw_gate, db_gate, dw_up, db_up, dw_down, dy2.sum(0)
