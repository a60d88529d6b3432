"""Per-GPU tuning as data: one frozen record per architecture, picked by one function.

Every measured constant the kernel choice (``select.py``) and the launchers read lives in a
``GpuPolicy`` (or ``CpuPolicy``) record here; no other module holds a tuned number. Each
record names the measurements behind it (results files under ``benchmarks/results/``; the
full measurements and the alternatives they beat: docs/design-notes/constants.md).

    policy_for(device)   the record for a device: H200, H100, FALLBACK (other CUDA GPUs), CPU
    launch_policy(device)  the GPU record the launchers read (CUDA's default for CPU tensors
                         under the Triton interpreter)
    patched(**changes)   a context in which policy_for returns records with fields replaced
                         (tests and tuning scripts; process-wide, so autograd's backward
                         threads see it too; restored on exit)

H100: the per-row and decode cost models refitted on the H100; its launch sizes,
decode configs and training constants are the H200's (``GpuPolicy.measured_on`` says so).
FALLBACK (any other CUDA GPU): H200's constants with narrower margins (sparse paths only where
the model predicts a clear win), never measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterator, Mapping, NamedTuple, Union

import torch


class DecodeConfig(NamedTuple):
    """Launch config of the decode kernels (runtime/cuda_decode.py) for one padded-M bucket."""
    bn: int        # neurons per program
    bk: int        # K step of the gate loop
    bku: int       # K step of the up loop (tile form)
    bko: int       # K_out step of the down loop (tile form)
    vec_m: int     # M <= vec_m: up/down one active neuron at a time with whole-row loads ("rows")
    finish_max: int  # finish in the kernel (last program) up to M x K_out elements, else a launch
    warps: int
    stages: int
    pb: int = 4        # list form: active (row, neuron) pairs per gather step of the up projection
    kc: int = 2048     # list form: K per step of that gather
    le: int = 64       # list form: list entries per step of the down gather
    bo: int = 128      # list form: K_out per down-gather program
    gwarps: int = 4    # list form: warps of the down-gather kernel
    lbn: int = 32      # list/pairs forms: neurons per program of the gate kernel
    udot: bool = False  # list form's up projection as tl.dot tiles (slower at K=2048 and 4096)
    lbk: int = 0       # K step of the list/pairs gate loop (0: bk)
    lstages: int = 0   # pipeline stages of the list/pairs first kernel (0: stages)
    koc: int = 2048    # pairs form: K_out per step of its W_d^T row loads and atomics
    gemv_bn: int = 0   # rows form at M=1: neurons per program of a whole-row GEMV gate (0: tl.dot gate)
    pbn: int = 0       # pairs form's own neurons per program (0: lbn)
    ppb: int = 0       # pairs form's pairs per trip (0: pb)
    pwarps: int = 0    # pairs form's warps (0: warps)
    # union form (kernels/twell_decode_union.py): its first launch (gate, up, the block's active
    # neurons listed) and its down launch over the union (K_out tiles x splits x row tiles)
    union_bn: int = 32      # neurons per program of the first launch (tl.dot's M side: <= 32 stays off wgmma)
    union_bk: int = 64      # K step of its gate and up loops
    union_warps: int = 4    # ... and its warps
    union_stages: int = 3   # ... and its pipeline stages
    union_bo: int = 32      # K_out per down program (tl.dot's M side: <= 32 stays off wgmma)
    union_c: int = 64       # union entries per step of the down loop
    union_s: int = 4        # splits of the union (1: y written directly, no atomics, no finish launch)
    union_mb: int = 0       # rows per down program (0: all M rows padded to a power of two)
    union_dwarps: int = 4   # warps of the down launch
    union_dstages: int = 2  # pipeline stages of the down launch
    # union2 form (kernels/twell_decode_union2.py): the gate by cuBLAS, a union-list launch, an up
    # launch over chunks of the compacted union, a down launch over K_out tiles x splits
    u2_bl: int = 64         # neurons per program of the union-list launch
    u2_c: int = 32          # union entries per up program (its gathered W_up rows)
    u2_bk: int = 128        # K step of the up loop
    u2_sk: int = 1          # splits of K in the up launch (> 1: partials summed by each chunk's last program)
    u2_mt: int = 32         # rows per tl.dot tile, up and down (its M side: <= 32 stays off wgmma)
    u2_mr: int = 0          # rows per up program, a multiple of u2_mt (0: all M rows padded)
    u2_warps: int = 4       # warps of the up launch
    u2_stages: int = 3      # ... and its pipeline stages
    u2_bo: int = 128        # K_out per down program (h read K_out / u2_bo times)
    u2_cd: int = 32         # union entries per step of the down loop
    u2_s: int = 8           # splits of the union (1: y written directly, no atomics, no finish launch)
    u2_dwarps: int = 4      # warps of the down launch
    u2_dstages: int = 2     # ... and its pipeline stages
    u2_dense_up: bool = False   # u for all of N by a cuBLAS GEMM (the whole W_up read) instead of the gather


MAX_M = 256           # decode kernels: row blocks of <= MAX_MB rows, up to this many rows
MAX_MB = 32           # rows per program: M-tiles of 64 select Hopper's wgmma, which gave wrong
                      # results at M_P=64 (Triton 3.6, H200)


def next_pow2(v: int) -> int:
    """The smallest power of two >= v, for v >= 1 (v <= 0 gives 2: (v - 1).bit_length() is 1)."""
    return 1 << max(0, (int(v) - 1).bit_length())


def m_pad(m: int) -> int:
    """The decode config bucket of M rows (a power of two, at least 16)."""
    return max(16, next_pow2(m))


def m_pad_rows(m: int) -> int:
    """Rows of the decode rows form's per-neuron up/down for M rows."""
    return next_pow2(m)


def rows_gemv(m: int, c: DecodeConfig) -> bool:
    """Whether the rows form gates M rows by the whole-row GEMV (M=1 where c.gemv_bn is set)."""
    return m == 1 and c.gemv_bn > 0


def rows_bn(m: int, c: DecodeConfig) -> int:
    """Neurons per program of the rows form for M rows: c.gemv_bn with the GEMV gate, else c.bn."""
    return c.gemv_bn if rows_gemv(m, c) else c.bn


def pairs_bn(c: DecodeConfig) -> int:
    """Neurons per program of the pairs form (c.pbn, else the list form's c.lbn)."""
    return c.pbn or c.lbn


def pairs_pb(c: DecodeConfig) -> int:
    """Active pairs per trip of the pairs form (c.ppb, else the list form's c.pb)."""
    return c.ppb or c.pb


def _frozen(d: Mapping) -> Mapping:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class GpuPolicy:
    """Measured constants of one GPU architecture. Rules are in select.py; units in each comment."""

    name: str
    measured_on: str                 # where the constants were measured (results files, dates)
    # -- inference, per-row TwELL path (select.twell_wins): cost in units of one dense
    #    M x K x N GEMM: gate_units + pair_units * d * (1 + g) / 2 < margin * (2 + g)
    gate_units: float
    pair_units: float                # W_u + W_d^T rows gathered from L2
    pair_units_hbm: float            # ... when W_u + W_d exceed l2_bytes
    l2_bytes: float
    margin: float
    min_tokens: int                  # the per-row path runs from this many tokens
    min_width: int                   # ... and K at least this
    probe_every: int                 # dense layers re-measure their density every this many calls
    refresh_every: int               # TwELL layers likewise
    # -- inference, decode path (select.decode_us): per form (fixed us, W_gate GB/s, work-term
    #    coefficients..., strided-read us per MB), in the order of select.decode_terms
    decode_max_m: int
    decode_forms: Mapping[str, tuple]
    dense_fixed_us: float            # eager's dense FFN at decode sizes: fixed + bytes / rate
    dense_gbps: float
    decode_margin: float             # decode runs while its time < decode_margin x dense's
    op_dense_host_us: float          # host time of the op's dense path per eager call
    decode_configs: Mapping[int, DecodeConfig]       # by padded M, K < wide_k
    wide_k: int
    wide_decode_configs: Mapping[int, DecodeConfig]  # by padded M, K >= wide_k
    # -- training (select.plan_train)
    train_min_tokens: int            # the sparse training kernels run from this many tokens
    train_min_width: int             # ... and K at least this (narrower: the dense path)
    sparse_max_density: float        # sparse while the layer's measured density is under this
    train_probe_every: int
    lost_row_pairs: int              # a row past the dense backup costs as many listed pairs
    compact_max_lost: float          # dense layers save the compact state up to this many lost rows
    # -- launch sizes, per-row inference kernels (runtime/cuda_infer.py)
    compact_bm: int = 16             # rows per compaction program, at most (compact_rows_per_program)
    compact_programs: int = 2048     # ... fewer rows per program (down to 4) below this many programs
    compact_ch: int = 256            # columns per compaction step
    compact_warps: int = 4
    compact_stages: int = 1          # > 1: Triton pipelines the column loop's loads this deep
    row_pairs: int = 1               # listed pairs per iteration of the fused row kernel
    row_prefetch: int = 1            # 0 none, 1 next (col, value), 2 next weight rows too,
                                     # 3 Triton's pipeliner: row_stages - 1 pairs in flight via cp.async
    row_stages: int = 1              # pipeline stages when row_prefetch == 3
    row_cols_per_warp: int = 1024    # warps = pow2(max(K, K_out)) / this
    row_buckets: int = 2             # the row kernel's order: rows over W, then the rest in
                                     # row_buckets - 1 bins by count, heaviest first
    row_split: int = 1               # > 1: the first row_split_rows rows in that order (the
                                     # heaviest where row_buckets > 2) take this many programs
                                     # each; a row among them over row_split_pairs listed pairs,
                                     # in a bucket that ends within them, is cut in even parts
    row_split_pairs: int = 48        # (at least 1)
    row_split_rows: int = 256
    row_split_skew: float = 0.0      # the plan splits (select.splits_rows) only calls of at most
    row_split_max_m: int = 0         # row_split_max_m tokens (0: any) of a layer whose latest
                                     # probe's heaviest row held over row_split_pairs non-zeros and
                                     # over row_split_skew times the mean: the split kernel costs
                                     # rows it does not split
    compact_transpose: bool = False  # W_down^T's per-call copy made by the compaction's launch
                                     # (tiles after its programs), not a launch of its own
    graphs_min_tokens: int = 0       # the per-row path's token bound where the call runs inside a
                                     # CUDA graph (reduce-overhead, twell.cudagraphs): GPU time alone
                                     # counts there; 0: min_tokens
    graphs_margin: float = 0.0       # rule 2's margin for calls under min_tokens (the band the
                                     # graphs bound opens; the cost model was fitted above it); 0: margin
    gate_cfg: int = -1               # the per-row path's gate GEMM: -1 cuBLAS, then a compaction
                                     # pass over g; c >= 0 twell::gate_pack's configuration c
                                     # (cuda_gate.CONFIGS), packing in its epilogue (bf16, sm90)
    gate_min_m: int = 0              # ... from this many tokens (fewer: cuBLAS and the compaction)
    gate_slots: int = 16             # ... slots per row and tile of its packed output
    gate_raster: int = 0             # ... tile order: 0 CUTLASS's heuristic, 1 along M, 2 along N
    gate_swizzle: int = 1            # ... CUTLASS's tile swizzle (1, 2, 4, 8)
    merge_bm: int = 16               # rows per merge_tiles_kernel program
    list_min: int = 32               # per-row list width bounds
    list_max: int = 1024
    eager_elementwise_max_m: int = 1024   # dense path without counts: eager's relu/mul up to here
    gemm_tflops: float = 720.0       # a dense bf16 GEMM's rate at prefill sizes (select.rows_us)
    op_dense_prefill_host_us: float = 0.0   # host time of a compiled module's eager dense call past
                                     # decode sizes: dense calls whose GEMMs' modeled GPU time
                                     # (select.dense_gemms_us) is under it replay the op's own graph
    op_rows_host_us: float = 0.0     # host time of a compiled module's eager per-row call: the per-row
                                     # path replays the op's own CUDA graph while its modeled GPU
                                     # time is under this (select.rows_host_bound; 0: never)
    dense_block: int = 1024          # columns per step of the relu*mul pass
    dense_warps: int = 4             # ... and its warps
    dense_programs: int = 264        # split rows into column spans below this many programs
    # -- launch sizes, training kernels (runtime/cuda_train.py)
    train_pairs: int = 4             # busy-row kernel: pairs per step
    fwd_pairs: int = 1
    fwd_cols_per_warp: int = 1024
    state_pairs: int = 4             # the dense path's compact-state writes
    state_cols_per_warp: int = 512
    wg_dy_entries: int = 4           # per-neuron weight-gradient passes
    wg_dy_cols_per_warp: int = 512
    wg_x_entries: int = 4
    wg_x_warps: int = 4
    wg_bk: int = 2048
    wg_chunk: int = 128              # a neuron's entries per wgrad program step: at least this,
    wg_chunk_over_mean: int = 2      # ... and this many mean lists (only hot neurons split)
    wg_programs_per_sm: int = 8      # persistent wgrad programs per SM
    wg_dy_maxnreg: int = 0           # > 0: the DY pass compiled to at most this many registers per
                                     # thread (ptxas), so more of its programs stay resident
    wg_x_maxnreg: int = 0            # ... the X pass likewise
    dx_pairs: int = 4
    rank_bm: int = 8
    rank_bp: int = 32
    busy_programs: int = 1024

    @functools.cached_property
    def launch_key(self) -> tuple:
        """The fields the inference launchers read (per-row, gate and dense paths) as one hashable
        tuple, for the op's own CUDA graphs: a graph replays only under the launch sizes it was
        captured with (a record made by ``patched`` is freed when its block closes, so its id()
        can come back as another record's)."""
        return tuple(getattr(self, f) for f in _LAUNCH_FIELDS)

    def split_rows(self, m: int) -> int:
        """How many of M rows (the first in the row kernel's order) a call the plan splits may
        split: row_split_rows, at most M; 0 where row_split is off."""
        return min(m, self.row_split_rows) if self.row_split > 1 else 0

    def compact_rows_per_program(self, m: int) -> int:
        """Rows per compaction program for M rows: compact_bm, fewer (down to 4) where M / 16
        programs would leave SMs idle (H100, M=2048: 0.036 ms at 4 rows against 0.046 at 16;
        tune_ffn.py --compact)."""
        return max(4, min(self.compact_bm, next_pow2(m // self.compact_programs)))

    def decode_config(self, m: int, k: int) -> DecodeConfig:
        """The decode launch config for M rows of width K."""
        return (self.wide_decode_configs if k >= self.wide_k else self.decode_configs)[m_pad(min(m, MAX_M))]


@dataclass(frozen=True)
class CpuPolicy:
    """Measured constants of the CPU path (runtime/cpu_ffn.py; docs/cpu.md)."""

    name: str
    measured_on: str
    min_tokens: int                  # the C++ kernel runs from this many tokens per call
    min_width: int                   # ... and K at least this (narrower: plain calls win)
    max_density_small: float         # the kernel's dense up/down above this density, M <= 4
    max_density_mid: float           # ... M <= 64
    max_density_large: float         # ... M > 64
    # Tokens per block of the sparse part. A block reads its union of active W_up rows and
    # W_down columns once, and at d=0.005 the union of 128 tokens is ~47% of N: fewer, larger
    # blocks read the weights fewer times, which outweighs x and y rows leaving L2 (M=2048:
    # 398 ms at 2048 tokens per block against 512 at 128; results/cpu-amd-epyc/kernel_probe.json).
    block_tokens: int

    def max_density(self, m: int) -> float:
        return self.max_density_small if m <= 4 else self.max_density_mid if m <= 64 else self.max_density_large


# Decode launch configs by padded M, K < 3072, tuned on the H200 (benchmarks/tune_decode.py):
# the pairs form at 16 neurons per program, 2 pairs per trip and 2 warps up to 16 rows; the
# list/pairs gate at K step 128, 5 stages; the rows form's GEMV gate at M=1 (12.5 us at 4
# neurons per program against 14.9 with the tl.dot gate over 32). Results:
# benchmarks/results/h200/ffn_decode.json. The union form's fields are not measured yet: 32
# neurons per first-launch program (176 programs at N=5632), down tiles of 32 K_out columns in 4
# splits (64 x 4 = 256 programs at K_out=2048, ~2 per SM of 132); from 128 rows 8 warps and 32
# entries per down step (the [32, M_P] fp32 tiles of g, u and the down accumulator in registers).
# The union2 form (docs/design-notes/decode.md "The union2 form"), measured at 16, 64 and 128
# rows (W_down stored transposed, results/h200/ffn_decode_union2_fields.json): the up launch's K
# in 4 splits, 128 union entries per down step from 64 rows, up chunks of 16 entries at 16 and
# 128 rows, 32 at 64 (graphed, PDL: 27.4 / 45.0 / 69.8 us against 29.4 / 56.4 / 88.3 with the
# first guesses); 32 and 256 rows keep those guesses (up chunks of 16 and 64 entries; at 256
# rows down tiles of 64 K_out columns x 4 splits, 8 row tiles of [32, 64] accumulators).
_DECODE_CONFIGS = {
    16: DecodeConfig(32, 256, 256, 256, 4, 0, 4, 3, lbk=128, lstages=5, gemv_bn=4, pbn=16, ppb=2, pwarps=2,
                     union_bk=128, u2_c=16, u2_sk=4),
    32: DecodeConfig(64, 128, 256, 256, 0, 0, 4, 3, lbk=128, lstages=5, union_bk=128, u2_c=16),
    64: DecodeConfig(64, 128, 256, 256, 0, 8192, 4, 3, lbk=128, lstages=5, u2_sk=4, u2_cd=128),
    128: DecodeConfig(64, 128, 256, 256, 0, 8192, 4, 3, lbk=128, lstages=5, union_warps=8, union_c=32,
                      u2_c=16, u2_sk=4, u2_cd=128, u2_dwarps=8),
    256: DecodeConfig(64, 128, 256, 256, 0, 8192, 4, 3, lbk=128, lstages=5, union_warps=8, union_c=32,
                      union_dwarps=8, u2_c=64, u2_warps=8, u2_bo=64, u2_s=4, u2_dwarps=8),
}
# K >= 3072 (tuned at K=4096, N=11008): 64 neurons per list/pairs program up to 16 rows (M=16
# 51.9 us against 55.8 at 32, dense 87.0); at 32+ rows 32 neurons and K_out steps of 1024 (68.8
# against 75.6 us with whole rows). The GEMV gate and the pairs form's own sizes were not
# measured at this width and stay off.
_WIDE_DECODE_CONFIGS = {
    16: _DECODE_CONFIGS[16]._replace(lbn=64, lbk=256, lstages=3, gemv_bn=0, pbn=0, ppb=0, pwarps=0),
    **{mp: c._replace(lbn=32, lbk=256, lstages=3, koc=1024) for mp, c in _DECODE_CONFIGS.items() if mp > 16},
}

_LAUNCH_FIELDS = ("compact_bm", "compact_programs", "compact_ch", "compact_warps", "compact_stages", "row_pairs",
                  "row_prefetch", "row_stages", "row_cols_per_warp", "row_buckets", "row_split", "row_split_pairs",
                  "row_split_rows", "compact_transpose", "gate_cfg",
                  "gate_min_m", "gate_slots", "gate_raster", "gate_swizzle", "merge_bm", "eager_elementwise_max_m",
                  "dense_block", "dense_warps", "dense_programs")

H200 = GpuPolicy(
    name="H200",
    measured_on="NVIDIA H200 (torch 2.11, Triton 3.6); the results files under benchmarks/results/h200/ "
                "(the DY weight-gradient pass's register cap measured on the H100)",
    # Per-row path: the cost model fitted to the forced-kernel column of bench_ffn.py at M =
    # 16384 and 65536 (pair_units_hbm once W_u and W_d leave the L2): TwELL below d = 0.0114 at
    # K=2048 N=5632, gated (benchmarks/results/h200/ffn_inference.json; fit_policy.py --check).
    gate_units=1.2, pair_units=145.0, pair_units_hbm=230.0, l2_bytes=50e6, margin=0.95,
    # Per-row calls from 4096 tokens in the default mode (inside CUDA graphs from graphs_min_tokens).
    # From 2048 tokens gated i.i.d. d=0.005 ran 1.21x of Inductor, but the activity profile's
    # layer 0.92-0.93x (its op alone 0.98-0.99x) and layers kept dense 0.96x non-gated, 0.98x /
    # 0.90x gated at d=0.012 / 0.02, their dense call replayed from the op's graph by the code of
    # 553cd03 (0.27x eager; results/h200/ffn_prefill.json, policy min_tokens=2048), so the bound stays.
    # With dense calls graphed and heavy rows split, the compiled module at 2048 tokens still read
    # 0.87x on the activity profile's layer (its op alone 1.14x), 0.92x gated at d=0.02 (op 1.00x)
    # and 0.74x non-gated i.i.d. (op 0.99x): the module's host time (results/h200/ffn_2048.json).
    # The 16-layer model at 1 x 2048 tokens: 0.876-1.097x of Inductor with it, 0.978-1.024x
    # without, over four processes each (results/h200/e2e_prefill_2048_default.json).
    min_tokens=4096, min_width=2048,
    probe_every=64, refresh_every=16,
    # Per-row calls replay the op's own graph while their modeled GPU time (select.rows_us: the
    # cost model's units times one M x K x N GEMM at gemm_tflops) is under 450 us, the eager
    # call's host time in a compiled module: at d=0.005 K=2048 N=5632 gated calls up to 4096
    # tokens, non-gated up to 8192. Non-gated at 8192 tokens eager 0.482-0.677 ms (host-bound,
    # 0.74-1.11x of Inductor), graphed 0.450 (1.20x); gated at 8192 eager 0.575 (1.38x) against
    # graphed 0.583, at 16384 1.103 / 1.126 (results/h200/ffn_prefill_graphs.json, rows with
    # policy rows_graph_max_m=4096 / 16384: eager / graphed, today --policy op_rows_host_us=0 /
    # 1e6). The dense GEMM: 0.064 / 0.130 / 0.258 ms at 2048 / 4096 / 8192 tokens (720-740
    # TFLOP/s, the same file's gate_ms).
    gemm_tflops=720.0, op_rows_host_us=450.0,
    # Decode cost model: least-relative-error fit of each forced form on the 56-point grid of
    # benchmarks/results/h200/ffn_decode.json (benchmarks/fit_policy.py --fit-decode); with
    # margin 0.9 no pick on that grid below 0.97x of dense.
    decode_max_m=64,
    decode_forms=_frozen({
        "rows": (5.11, 2243.0, 4.2777, 0.2687),
        "tiles": (18.47, 1395.0, 1.4772, 0.0017, 0.0001),
        "list": (33.27, 1585.0, 8.1891, 0.1743, 1.1288),
        "pairs": (2.84, 1467.0, 0.0, 0.2871),
    }),
    dense_fixed_us=16.27, dense_gbps=3807.0, decode_margin=0.9,
    # the op's dense path's host time per eager call at M=64: 99-154 us (bench_host.py)
    op_dense_host_us=100.0,
    # Past decode sizes a dense call replays the op's own graph while its GEMMs' modeled time is
    # under 250 us: up to 2048 tokens at K=2048 N=5632 (gated 197 us, 4096: 394). At 2048 tokens
    # and d=0.02 the eager dense call took 240-263 us of host time back to back, the compiled
    # module 499 against 204 us of GPU time (profile_product.py --M 2048 --density 0.02 --policy
    # min_tokens=2048); graphed, the op ran 1.00x of Inductor (results/h200/ffn_2048.json). At
    # 4096 tokens the graph gained nothing (results/h200/ffn_dense_graph_ab.json).
    op_dense_prefill_host_us=250.0,
    decode_configs=_frozen(_DECODE_CONFIGS), wide_k=3072, wide_decode_configs=_frozen(_WIDE_DECODE_CONFIGS),
    # Training: sparse while the density is under the sparse/dense crossover (58-75 non-zeros per
    # row at M=16384 K=2048 N=5632; benchmarks/results/h200/ffn_training.json), with a margin.
    # Densities move fast in training: probe every call. A row past the backup is recomputed, at
    # the cost of lost_row_pairs pairs. train_min_width: under it the per-row kernels' fixed
    # costs outweigh the GEMMs they save, as for inference's min_width.
    train_min_tokens=8192, train_min_width=2048, sparse_max_density=0.011, train_probe_every=1, lost_row_pairs=14000,
    compact_max_lost=0,
    # Compaction's column loop pipelined 3 deep: 4 rows per program at M=2048 0.023 ms against
    # 0.040, 4096 0.034 / 0.035, 8192 0.055 / 0.058 (H200, tune_ffn.py --M 2048 4096 8192 --density
    # 0.005 --tail 0 --compact 4,256,4,1 4,256,4,3; results/h200/tune_compact.json)
    compact_stages=3,
    # Gate GEMM from 4096 tokens: twell::gate_pack's configuration 4 (128x128 tile per warpgroup,
    # ping-pong, so one warpgroup's packing epilogue overlaps the other's mainloop), g written
    # only where the packing spills, then merge_rows. The per-row path's GPU time (CUDA graph
    # replays, y bit-equal) gated 290.3 / 558.0 us at 4096 / 8192 tokens against cuBLAS +
    # compaction's 302.5 / 576.7, non-gated 225.3 / 427.6 against 236.0 / 439.7; at 2048 slower,
    # 167.8 against 162.0 gated (results/h200/gate_min_m_ab.json). The forward at 16384 / 65536
    # tokens 1.125 / 4.498 ms against 1.178 / 4.555 with g written whole (h200/gate_whole.json);
    # the gate + packing with g only where it spills 0.98-1.01x of cuBLAS from 16384 tokens
    # (h200/gate_spills.json).
    gate_cfg=4, gate_min_m=4096,
    # W_down^T's per-call copy made in the compaction's launch: the per-row path's GPU time at
    # K=2048 N=5632 d=0.005, gated 2048 / 4096 / 8192 tokens 161.5 / 302.0 / 573.7 us against
    # 165.5 / 309.6 / 582.4 with a transpose launch of its own, non-gated 129.1 / 236.7 / 439.0
    # against 133.0 / 242.1 / 446.3 (y bit-equal; results/h200/ffn_compact_transpose_ab.json)
    compact_transpose=True,
    # Rows heaviest first, in 8 buckets by count: the per-row path's GPU time on the activity
    # profile's layer (34 non-zeros per row, up to 169) at 4096 tokens 300.5 us against 360.3 with
    # rows over W first (4 buckets: 314.3); i.i.d. gated 2048-16384 tokens within 1%, non-gated
    # within 1% to 8192 and 817.8 against 800.7 at 16384 (results/h200/row_buckets_ab.json).
    row_buckets=8,
    # Heavy rows split in 2 parts (the heaviest 256 in order, over 64 non-zeros) where a layer's
    # measured peak row is over 3x its mean, up to 2048 tokens: the activity profile's layer
    # (34 non-zeros per row, up to 149 at 2048 tokens: probes/row_skew.py) at 2048 tokens 174.4 us
    # against 210.6 whole, at 4096 298.9 against 299.7; on i.i.d. rows the split kernel, splitting none, cost 0.2-5.8%
    # (gated 2048: 173.0 against 163.5 us; results/h200/row_split_ab.json), hence the plan's test.
    row_split=2, row_split_pairs=64, row_split_skew=3.0, row_split_max_m=2048,
    # Inside CUDA graphs (host time does not count) the per-row path from 2048 tokens: under
    # reduce-overhead 1.17-1.19x / 1.29-1.37x / 1.37-1.40x of Inductor at 2048 / 4096 / 8192
    # tokens over two runs (i.i.d. d=0.005; results/h200/ffn_prefill_reduce_overhead.json), the
    # activity profile's layer at 2048 1.04x on the GPU (op 0.2065 against Inductor's 0.2145 ms).
    # The 16-layer model at 1 x 2048 tokens (densities 0.49-0.87%): 1.029x with it, 0.974x
    # without, within the runs' spread (results/h200/e2e_prefill_reduce_overhead.json).
    graphs_min_tokens=2048,
    # ... with a narrower margin there: at 2048 tokens the forced per-row kernel ran 1.37x /
    # 1.19x / 1.08x / 0.93x of Inductor at d = 0.003 / 0.005 / 0.007 / 0.009 gated and 1.08x /
    # 0.96x / 0.86x at 0.003 / 0.005 / 0.008 non-gated (results/h200/ffn_small_m.json), where
    # margin 0.95 would run it up to d=0.0114 / 0.0097; 0.75 runs it up to 0.0072 / 0.0041.
    graphs_margin=0.75,
    # Launch sizes: the fastest of the probes of bench_ffn.py / bench_ffn_train.py at M=16384
    # K=2048 d=0.005 (the fused row kernel at 1 pair / 2 warps: 493 us against 531 at 4 / 4),
    # the wgrad passes' by the whole model's step (bench_e2e.py --train).
    # The DY weight-gradient pass capped at 128 registers per thread (164 uncapped, no spills
    # capped: benchmarks/probes/sass_loop.py wgrad_dy --maxnreg 128), so 4 programs of 4 warps stay resident
    # per SM instead of 3: on the H100 the pass 0.620 ms against 0.884 uncapped (tune_wgrad.py
    # --M 16384, results/h100/tune_wgrad.json), the step 3.16 ms against 3.41-3.82 before the
    # pass lost its division (bench_ffn_train.py --config; results/h100/ffn_training_ab.json).
    # The same SM and register file on the H200; not timed there.
    wg_dy_maxnreg=128,
)

# H100 (80 GB HBM3): the inference constants refitted on it, and the dense training path's saved
# state; launch sizes, decode configs and the other training constants are the H200's.
H100 = dataclasses.replace(
    H200, name="H100",
    measured_on="NVIDIA H100 80GB HBM3 (torch 2.11, Triton 3.6): per-row and decode cost "
                "models, the row kernel's pipelined list loop, W_down^T made in the compaction's launch, the "
                "per-row path's bound inside CUDA graphs, the fused gate's bound, the "
                "DY weight-gradient pass's register cap, the dense training path's saved state; other "
                "launch sizes, decode configs and the other training constants are the H200's",
    # Per-row path: least-relative-error fit of the forced-kernel column at M = 16384 and 65536
    # (benchmarks/results/h100/ffn_inference.json): TwELL below d = 0.0082.
    # The per-row path from 4096 tokens, its calls replaying the op's own graph (below): i.i.d.
    # 1.20x of Inductor at 4096 and 1.10x at 2048 (results/h100/ffn_prefill.json), but a trained
    # layer's activity (h100_activity.json layer 3: denser first tokens, hot neurons; 34
    # non-zeros per row) 0.95x at 2048 (1.14x at 4096; results/h100/ffn_prefill_buckets.json),
    # so 2048 stays dense.
    min_tokens=4096,
    gate_units=1.43, pair_units=174.0,
    # Per-row calls replay the op's own CUDA graph while their modeled GPU time is under 500 us:
    # at d=0.005 K=2048 N=5632 gated calls up to 4096 tokens (302 us modeled; 8192: 604),
    # non-gated up to 8192 (490). A compiled module's eager non-gated call at 8192 tokens took
    # 486 us of host time against 460 us of GPU time (profile_product.py --M 8192 --non-gated):
    # host-bound: 0.66x-1.16x of Inductor over four runs, 1.12x graphed in two (rows with policy
    # op_rows_host_us=400 / 500 in results/h100/ffn_prefill_graphs.json). Gated calls' eager
    # launches took 491 / 381 us of host time per op call at 2048 / 4096 tokens against ~200 /
    # ~320 us of GPU time, graphed 76 / 91 us (profile_product.py --M 2048 / 4096 --policy
    # min_tokens=2048, graphs off / on); the compiled module 0.37x -> 1.04x and 0.71x -> 1.18x of
    # Inductor. Gated at 8192 eager 1.31-1.32x, graphed 1.27-1.28x while graphs cloned y (the clone
    # cost more than the host time saved; rows with policy op_rows_host_us=500 / 700, same file).
    op_rows_host_us=500.0,
    # The split of heavy rows, and dense calls past decode sizes graphed: not measured on the H100.
    row_split=1, op_dense_prefill_host_us=0.0,
    # Row kernel's list loop pipelined by Triton (cp.async, 3 pairs' weight rows in flight, 24 KB
    # of shared memory per program): K=2048 N=5632 d=0.005, M=16384 0.573 ms against 0.593, M=65536
    # 2.212 / 2.370, M=4096 0.169 / 0.169-0.181 (tune_ffn.py --fused 1,1,1024 1,3,1024,4).
    # Every variant ran at 6.2-6.9 TB/s of weight rows: the gathers' floor is 7.6 (h100/floor.json).
    row_prefetch=3, row_stages=4,
    # Inside CUDA graphs the per-row path from 2048 tokens: under reduce-overhead at 2048 tokens
    # the activity profile's layer 1.00x of Inductor (0.225 against 0.225 ms), i.i.d. d=0.005
    # 1.11x (0.205 against 0.227; results/h100/ffn_prefill_reduce_overhead.json). Its margin
    # there: gated 1.28x / 1.11x / 0.99x / 0.84x at d = 0.003 / 0.005 / 0.007 / 0.009, non-gated
    # 1.00x / 0.90x at 0.003 / 0.005 against Inductor's fastest reading of the point
    # (results/h100/ffn_small_m.json); 0.85 runs it up to d=0.0064 gated, 0.0031 non-gated.
    graphs_min_tokens=2048, graphs_margin=0.85,
    # W_down^T's per-call copy made in the compaction's launch: the per-row path's GPU time at
    # K=2048 N=5632 d=0.005, gated 2048 / 4096 / 8192 / 16384 tokens 181.3 / 324.8 / 615.0 /
    # 1180.2 us against 187.9 / 335.3 / 629.1 / 1188.6 with a transpose launch of its own,
    # non-gated 147.3 / 249.2 / 463.6 / 911.6 against 154.3 / 260.4 / 475.3 / 923.7 (y bit-equal;
    # results/h100/ffn_compact_transpose_ab.json)
    compact_transpose=True,
    # Fused gate from 8192 tokens: the per-row path's GPU time (CUDA graph replays, y bit-equal)
    # gated 589.0 us at 8192 tokens against cuBLAS + compaction's 608.8, non-gated 444.7 against
    # 456.9; at 4096 slower, 328.1 against 322.2 gated, 252.1 against 246.4 non-gated
    # (results/h100/gate_min_m_ab.json). At 16384 / 65536 the forward 1.184 / 4.794 ms against
    # 1.195 / 4.920 (g written whole; h100/gate_whole.json).
    gate_min_m=8192,
    # Rows heaviest first, in 8 buckets by count: the activity profile's layer (34 non-zeros per
    # row, 6-137) at 2048 / 4096 tokens 0.91x / 1.09x of Inductor with rows over W first, 0.95x /
    # 1.14x in buckets (results/h100/ffn_prefill_buckets.json).
    row_buckets=8,
    # Decode cost model: benchmarks/fit_policy.py --fit-decode on benchmarks/results/h100/
    # ffn_decode.json (56 points): HBM 2.6 TB/s for eager's dense FFN (H200: 3.8).
    decode_forms=_frozen({
        "rows": (3.68, 1689.0, 4.453, 0.3255),
        "tiles": (17.87, 1228.0, 1.3963, 0.0019, 0.0001),
        "list": (33.89, 1231.0, 9.2562, 0.1282, 1.3004),
        "pairs": (2.58, 1240.0, 0.0, 0.3231),
    }),
    dense_fixed_us=14.41, dense_gbps=2599.0,
    # Training: sparse/dense break-even near 44 non-zeros per row (0.78%) at M=16384 and 65536,
    # K=2048, N=5632 (benchmarks/results/h100/ffn_training.json).
    sparse_max_density=0.0075,
    # Training: a dense layer saves g and u, not the compact state: faster, and still under
    # Inductor's peak memory (4 dense layers: 68.89 ms against the compact state's 70.00;
    # benchmarks/results/h100/e2e_train_nopenalty_saved_gu.json).
    compact_max_lost=-1)

FALLBACK = dataclasses.replace(
    H200, name="fallback",
    measured_on="constants of the H200 with narrower margins; never measured on this GPU",
    margin=0.8, decode_margin=0.75, sparse_max_density=0.008, min_tokens=8192, graphs_min_tokens=0, graphs_margin=0.0,
    op_rows_host_us=0.0, gate_cfg=-1)

# The C++ kernel against eager's dense calls (what an FFN costs inside a compiled graph) and
# Inductor's compiled FFN, fp32, 2 threads, d = 0.005, path="cpu", 2-core AMD EPYC (AVX2): from
# K = 512 it beats both at every token count (K=512: 2.67x of Inductor at 1 token, 1.98x at
# 512; K=2048: 2.39x / 2.42x); narrower, eager's calls win at few tokens (K=256, 1 token: 0.133
# against 0.098 ms; K=128, 16 tokens: 0.121 against 0.086) (results/cpu-amd-epyc/ffn_widths.json).
# Above 2% counted density at M > 64 the sparse part lost up to K=512 (0.63-0.97x of Inductor,
# docs/cpu.md): the kernel takes its dense branch there (max_density_large).
CPU = CpuPolicy(name="cpu", measured_on="2-core AMD EPYC (AVX2), torch 2.13 CPU",
                min_tokens=1, min_width=512, max_density_small=0.5, max_density_mid=0.12, max_density_large=0.02,
                block_tokens=2048)

Policy = Union[GpuPolicy, CpuPolicy]
_by_index: dict[int, GpuPolicy] = {}
_patches: list[dict] = []  # patched() blocks open, innermost last: policy_for's fast path when empty
_patches_lock = threading.Lock()
_patched_cache: dict[int, Policy] = {}   # id(base record) -> the record with _patches applied
generation = 0           # bumped whenever a patched() block opens or closes (plans made before are stale)


def gpu_policy_for_name(name: str) -> GpuPolicy:
    """The record for a CUDA device name (``torch.cuda.get_device_name``)."""
    upper = name.upper()
    if "H200" in upper:
        return H200
    if "H100" in upper:
        return H100
    return FALLBACK


def policy_for(device: Union[torch.device, str]) -> Policy:
    """The record for ``device``: its GPU's (cached per device index; no sync), or the CPU's.
    On every op call: a dict lookup unless ``patched`` is active somewhere."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda":
        base: Policy = CPU
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
        base = _by_index.get(index)
        if base is None:
            base = _by_index.setdefault(index, gpu_policy_for_name(torch.cuda.get_device_name(index)))
    return _with_patches(base) if _patches else base


def _with_patches(base: Policy) -> Policy:
    # one replaced record per base while the patches stand (patched() clears the cache): a
    # dataclasses.replace per call cost ~45 us of host time per launcher, and profiles taken
    # under --policy read that as the product's
    got = _patched_cache.get(id(base))
    if got is not None:
        return got
    with _patches_lock:
        fields = {f.name for f in dataclasses.fields(base)}
        merged = {k: v for c in _patches for k, v in c.items() if k in fields}
        got = dataclasses.replace(base, **merged) if merged else base
        _patched_cache[id(base)] = got
    return got


def launch_policy(device: Union[torch.device, str]) -> GpuPolicy:
    """The GPU record the launchers read for tensors on ``device``: the device's own; for CPU
    tensors (the Triton kernels under TRITON_INTERPRET=1) the default CUDA record."""
    device = torch.device(device)
    return policy_for(device) if device.type == "cuda" else cuda_default()  # type: ignore[return-value]


def cuda_default() -> GpuPolicy:
    """The record compile-time rules use for CUDA when no device can be asked (no GPU here):
    the current device's where CUDA is available, else H200's (the most measured)."""
    if torch.cuda.is_available():
        return policy_for(torch.device("cuda"))          # type: ignore[return-value]
    return _with_patches(H200)                           # type: ignore[return-value]


@contextlib.contextmanager
def patched(**changes) -> Iterator[None]:
    """Within the block, ``policy_for`` returns records with these fields replaced (a field a
    record lacks is ignored for it; an unknown name raises), in every thread (the autograd
    engine runs backward passes, and checkpoint recomputes, on threads of its own). For tests
    and tuning scripts: it changes what the rules and launchers read, nothing else."""
    known = {f.name for f in dataclasses.fields(GpuPolicy)} | {f.name for f in dataclasses.fields(CpuPolicy)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise ValueError(f"unknown policy fields {unknown}; known: {sorted(known)}")
    global generation
    entry = dict(changes)
    with _patches_lock:
        _patches.append(entry)
        _patched_cache.clear()
        generation += 1
    try:
        yield
    finally:
        with _patches_lock:
            del _patches[next(i for i, e in enumerate(_patches) if e is entry)]
            _patched_cache.clear()
            generation += 1
