"""Dense-or-sparse choice for the CUDA inference op, made without a per-call host sync.

Three rules, in this order:

1. Shape rule (host, from shapes and dtypes only), bf16/fp16 only:
   - decode path (kernels/cuda_decode.py) for 1 <= M <= DECODE_MAX_M tokens, any K, N;
   - per-row TwELL path for M >= MIN_TOKENS, MIN_WIDTH <= K (narrower layers measured slower
     than dense), K and K_out <= 8192 (the fused kernel holds a whole x row and y row in
     registers), N <= 65536 (16-bit columns in the per-row lists).
   Everything else runs dense (eager's own calls, bit-identical to eager). Between the two
   thresholds (H200, K=2048, N=5632, CUDA graphs, docs/inference.md "Decode"): decode forced
   0.17-0.57x of dense at M 64-256, per-row path 0.90x at M=512 but 1.18x at M=2048 for
   d=0.005 (MIN_TOKENS, set from eager timings, left as is).
   fp32 stays dense: tl.dot would round its operands to tf32 (about 3e-4 relative error),
   over twice eager fp32's error.
2. Density rule (per layer, lagged): every probe call, dense or TwELL, writes the layer's
   non-zero count of relu(gate(x)) into a device tensor (TwELL: summed from the counts the
   gate kernel writes; dense: one count over h_g). A non-blocking copy to pinned host memory
   and a CUDA event carry it back; a later call reads it only once ``event.query()`` says it
   has landed (never waits). With d the measured density and g = 1 for a gated FFN, the layer
   runs TwELL while the cost model, in units of one dense M x K x N GEMM,

       GATE_UNITS + PAIR_UNITS * d * (1 + g) / 2  <  MARGIN * (2 + g)

   holds (cuBLAS gate + compaction pass + per-row fused kernel vs dense FFN), dense
   otherwise; PAIR_UNITS_HBM replaces PAIR_UNITS when W_u and W_d together exceed L2_BYTES
   (the fused kernel gathers a row of each per active pair). The constants are measured
   (docs/inference.md). A layer starts dense (a probe
   call), so a dense layer never pays for a sparse first call; dense layers re-probe every
   PROBE_EVERY calls, TwELL layers every REFRESH_EVERY calls. The measured density also sets
   the per-row list width (cuda_infer.list_width).
3. Decode rule (M <= DECODE_MAX_M, same per-layer key and measurement): with d the density,
   u = 1-(1-d)^R the expected fraction of neurons active in at least one of a row block's
   R <= 32 rows, B row blocks, BN / LBN neurons per program and vec_m (cuda_decode.CONFIGS),
   one predicted time per up/down form of the decode path (decode_us):

       tiles (each block with an active neuron adds its [R, K_out] tile into the accumulator:
             R x K_out atomics per such block, N_a = N / BN x (1 - (1-u)^BN) of them):
             DEC_TILES_FIXED_US + B * bytes(W_g) / DEC_TILES_GATE_GBPS
              + DEC_TILES_ADD_US * R * B * N_a * K_out / 1e6
              + DEC_TILES_ENTRY_US * u * N * B * (K + K_out) / 4096
       rows (M <= vec_m: one active neuron at a time, whole-row loads, a chain of u * BN steps per
             program, each moving a W_u row, M x K_out atomics and a W_d^T row):
             DEC_ROWS_FIXED_US + bytes(W_g) / DEC_ROWS_GATE_GBPS + DEC_ROWS_STEP_US * u * BN * (K + M_P * K_out) / 4096 (BN: cuda_decode.rows_bn)
       list (two launches: gate + up per active pair into per-token lists, then a gather per
             token; steps grow with the pairs per program and the entries per token):
             DEC_LIST_FIXED_US + B * bytes(W_g) / DEC_LIST_GATE_GBPS
             + DEC_LIST_PAIR_US * d * R * LBN * K / 4096 + DEC_LIST_ENTRY_US * d * N * K_out / 4096
       pairs (two launches: gate, up and the down's atomics per active pair, then the finish;
             a program's chain of trips, PB pairs each, moves W_u and W_d^T rows; B row blocks
             run B times the programs on the same SMs; LBN, PB: cuda_decode.pairs_bn/pairs_pb):
             DEC_PAIRS_FIXED_US + B * bytes(W_g) / DEC_PAIRS_GATE_GBPS
             + DEC_PAIRS_TRIP_US * d * R * B * LBN / PB * (K + K_out) / 4096

   The fastest form is the one run (decode_form), and the decode path runs while its time is
   under DEC_MARGIN * (DENSE_FIXED_US + bytes(W_g + W_u + W_d) / DENSE_GBPS) (decode_wins).
   Under torch.use_deterministic_algorithms(True) only the list form (no atomics) is
   considered: same inputs, same bits (the others sum in the order their atomics land).
   Before the layer's first measurement lands the rule is evaluated at density 0, the best
   case (a ReLU layer the backend rewrote is expected sparse, and a CUDA graph recorded on the
   second call, as reduce-overhead's cudagraph trees do, would otherwise keep dense forever).
   The decode kernels write the non-zero count, so the probe works as on the per-row path. The
   constants are least-squares fits to a device run (tune_decode.py, docs/inference.md
   "Decode"); where even density 0 cannot win, dispatch.static_dense_reason leaves static
   decode-sized FFNs to Inductor.

Under CUDA-graph capture nothing is polled or copied: the graph records the path chosen by
the calls before capture (torch.compile's reduce-overhead mode runs warm-up calls first).

State is per op instance: the passes give every op they insert an ``instance`` number unique
in the process (ops.next_instance), and dispatch runs each call inside its op's scope
(``enter``), so a key (layer name, shapes) names a layer within one compiled op only: a
second model with the same layer names starts unmeasured. Direct calls of the op share
instance 0. ``reset`` (also run by ``torch._dynamo.reset()``) forgets everything.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

# Measured on H200 (session 15 run 6: bench_ffn.py's forced-kernel column, M = 16384 and 65536,
# tail 0), in units of one dense M x K x N GEMM (the cuBLAS gate alone): TwELL = GATE_UNITS
# (gate + compaction + the fused kernel's fixed part) + PAIR_UNITS x d (gated), least relative
# error: 1.21 + 145 d at K=2048 N=5632 (W_u + W_d 46 MB, in L2), 1.16 + 230 d at K=4096
# N=11008 (180 MB). Dense (Inductor) 2.8-3.1 units. TwELL for d < 0.0114 (K=2048; d=0.01
# measured 1.08-1.16x of Inductor) and d < 0.0072 (K=4096), gated. A long tail costs more than
# its density says (tail 0.2, d=0.009: 0.3 units over the line at K=2048, still 1.01-1.07x of
# Inductor; left dense at K=4096). Session 14's kernels: 1.51 + 163 d, TwELL for d < 0.0082.
GATE_UNITS = 1.2
PAIR_UNITS = 145.0
PAIR_UNITS_HBM = 230.0
L2_BYTES = 50e6        # H100 / H200 L2
MARGIN = 0.95
MIN_TOKENS = 8192      # H200 d=0.005: M=4096 twell 0.48 vs dense 0.44 ms, M=1024 0.20 vs 0.12
MIN_WIDTH = 2048       # per-row path measured winning at K = 2048 and 4096 (1.36x, 1.21x); at
                       # K=512, N=1408 (issue 6's model, 16384 tokens, density 0.003, H200) the
                       # whole forward ran 0.71x of Inductor: its fixed per-row costs don't shrink
                       # with K as the dense GEMMs do
MAX_WIDTH = 8192
# Decode rule (rule 3), H200 bf16, decode kernels v5 (rows, tiles: one launch), the list form
# and the pairs form (two launches each), launched with PDL (cuda_decode.pdl_ok; without it
# each form's fixed part is ~1.2 us more), statistics added into counters, the rows form's
# GEMV gate at M=1 and the pairs form's own config up to 16 rows. W_down^T rows are read
# through W_down's transposed view (strided: no copy to go stale), a 32 B sector per element,
# hence every form's STRIDED term. Fitted by benchmarks/tune_decode.py --fit-from on the
# committed 56-point grid, each form forced (results/h200/ffn_decode.json, 2026-11-25; within
# 1.6x of dense, least relative error, coefficients >= 0; list, never near dense, on all its
# points). Dense: 16.27 us + bytes / 3807 GB/s. K=2048, N=5632, d=0.005 (results/h200/
# ffn_decode.json, 2026-11-25): M=1 rows 14.9 us (2.28x of dense; 12.6 us with the stale-prone
# copy), M=16 pairs 28.2 us vs dense 34.3 (1.22x). MARGIN 0.9: on the grid no pick below
# 0.97x of dense (tests/kernels/test_decode.py).
DECODE_MAX_M = 64
DEC_ROWS_FIXED_US = 5.11
DEC_ROWS_GATE_GBPS = 2243.0
DEC_ROWS_STEP_US = 4.2777
DEC_TILES_FIXED_US = 18.47
DEC_TILES_GATE_GBPS = 1395.0
DEC_TILES_ADD_US = 1.4772
DEC_TILES_ENTRY_US = 0.0017
DEC_LIST_FIXED_US = 33.27
DEC_LIST_GATE_GBPS = 1585.0
DEC_LIST_PAIR_US = 8.1891
DEC_LIST_ENTRY_US = 0.1743
DEC_PAIRS_FIXED_US = 2.84
DEC_PAIRS_GATE_GBPS = 1467.0
DEC_PAIRS_TRIP_US = 0.0
DEC_ROWS_STRIDED_US = 0.2687
DEC_TILES_STRIDED_US = 0.0001
DEC_LIST_STRIDED_US = 1.1288
DEC_PAIRS_STRIDED_US = 0.2871
DENSE_FIXED_US = 16.27
DENSE_GBPS = 3807.0
DEC_MARGIN = 0.9
DETERMINISTIC_FORMS = ("list",)   # the decode forms that sum without atomics
MAX_N = 65536          # the per-row lists pack the column in 16 bits
PROBE_EVERY = 64
REFRESH_EVERY = 16
DTYPES = (torch.bfloat16, torch.float16)


def shape_ok(x: Tensor, m: int, k: int, k_out: int, n: int, tile_n: int = 0, slots: int = 0) -> bool:
    """tile_n/slots: the op's TwELL config; the per-row path does not depend on them."""
    return (x.is_cuda and x.dtype in DTYPES and m >= MIN_TOKENS and MIN_WIDTH <= k <= MAX_WIDTH
            and k_out <= MAX_WIDTH and 1 <= n <= MAX_N)


def decode_ok(x: Tensor, m: int, n: int) -> bool:
    """Decode path shape rule: bf16/fp16 CUDA, 1 <= M <= DECODE_MAX_M tokens."""
    return x.is_cuda and x.dtype in DTYPES and 1 <= m <= DECODE_MAX_M and n >= 1


def union_fraction(density: float, m: int) -> float:
    """Expected fraction of neurons active in at least one of m rows (independent rows)."""
    d = min(max(float(density), 0.0), 1.0)
    return 1.0 - (1.0 - d) ** m


def tiles_active(u: float, n: int, bn: int) -> float:
    """Expected neuron blocks of BN with an active neuron when a fraction u of N is active."""
    return n / bn * (1.0 - (1.0 - u) ** bn)


# Each decode form's constants, in the order of its terms in decode_terms (the second is a
# rate: the term is bytes(W_g) in MB, its coefficient 1e3 / GB/s); tune_decode.py fits them.
# The last term of every form: W_down^T rows read through W_down's transposed view, one 32 B
# sector per element (no copy is kept: a copy went stale), in MB per call.
DECODE_CONSTANTS = {
    "tiles": ("DEC_TILES_FIXED_US", "DEC_TILES_GATE_GBPS", "DEC_TILES_ADD_US", "DEC_TILES_ENTRY_US",
              "DEC_TILES_STRIDED_US"),
    "list": ("DEC_LIST_FIXED_US", "DEC_LIST_GATE_GBPS", "DEC_LIST_PAIR_US", "DEC_LIST_ENTRY_US",
             "DEC_LIST_STRIDED_US"),
    "pairs": ("DEC_PAIRS_FIXED_US", "DEC_PAIRS_GATE_GBPS", "DEC_PAIRS_TRIP_US", "DEC_PAIRS_STRIDED_US"),
    "rows": ("DEC_ROWS_FIXED_US", "DEC_ROWS_GATE_GBPS", "DEC_ROWS_STEP_US", "DEC_ROWS_STRIDED_US"),
}


def decode_terms(density: float, u: Optional[float], m: int, k: int, n: int, k_out: int) -> dict[str, list[float]]:
    """Per decode form the terms of its predicted time for M rows (the formulas of rule 3
    above, each without its constant): 1, bytes(W_g) in MB, then the form's work terms; "rows"
    only where M <= vec_m. ``u``: fraction of neurons active in some row of a row block
    (measured where fitted; None: union_fraction's expectation)."""
    from twell_compile.kernels import cuda_decode

    c = cuda_decode.config_for(m, k)
    mb = min(cuda_decode.m_pad(min(m, cuda_decode.MAX_M)), cuda_decode.MAX_MB)
    rows, blocks = min(m, mb), -(-m // mb)
    d = min(max(float(density), 0.0), 1.0)
    if u is None:
        u = union_fraction(d, rows)
    gate_mb = 2e-6 * n * k * blocks
    strided_mb = 32e-6 * u * n * blocks * k_out       # a sector per W_down element of the union
    out = {
        "tiles": [1.0, gate_mb, rows * blocks * tiles_active(u, n, c.bn) * k_out / 1e6,
                  u * n * blocks * (k + k_out) / 4096],
        "list": [1.0, gate_mb, d * rows * c.lbn * k / 4096, d * n * k_out / 4096],
        "pairs": [1.0, gate_mb,
                  d * rows * blocks * cuda_decode.pairs_bn(c) / cuda_decode.pairs_pb(c) * (k + k_out) / 4096],
    }
    if m <= c.vec_m:
        out["rows"] = [1.0, gate_mb, u * cuda_decode.rows_bn(m, c) * (k + cuda_decode.m_pad_rows(m) * k_out) / 4096]
    for terms in out.values():
        terms.append(strided_mb)
    return out


def decode_us(density: float, m: int, k: int, n: int, k_out: int) -> dict[str, float]:
    """Predicted decode time (us) of each up/down form the decode path can run for M rows
    ("rows" only where M <= vec_m): decode_terms times DECODE_CONSTANTS. On the op's host path
    (use_decode, every call)."""
    g = globals()
    out = {}
    for form, t in decode_terms(density, None, m, k, n, k_out).items():
        names = DECODE_CONSTANTS[form]
        us = g[names[0]] + 1e3 * t[1] / g[names[1]]
        for name, x in zip(names[2:], t[2:]):
            us += g[name] * x
        out[form] = us
    return out


def _forms_us(density: float, m: int, k: int, n: int, k_out: int,
              forms: Optional[tuple[str, ...]]) -> dict[str, float]:
    t = decode_us(density, m, k, n, k_out)
    return t if forms is None else {f: v for f, v in t.items() if f in forms}


def decode_pick(density: float, m: int, k: int, n: int, k_out: int, gated: bool,
                forms: Optional[tuple[str, ...]] = None) -> Optional[str]:
    """The up/down form predicted fastest (cuda_decode.FORMS; only ``forms`` if given) when it
    beats DEC_MARGIN x the dense FFN's predicted time, else None (dense)."""
    t = _forms_us(density, m, k, n, k_out, forms)
    form = min(t, key=t.get)
    return form if t[form] < DEC_MARGIN * dense_us(k, n, k_out, gated) else None


# H200 host: the op's dense path (dispatch, policy, three F.linear, relu and mul) issues in
# 99-154 us per call at M=64 (bench_host.py "op_nograph", results/h200/session11/run7/: K=4096
# 99, K=2048 154) and this host's Python timings spread 1.5-2.5x between runs (run12/: 184-471
# us at K=4096, M=1, whose GEMMs take 76 us); a graphed call costs its copy and clone on the GPU
OP_DENSE_HOST_US = 100.0


def dense_us(k: int, n: int, k_out: int, gated: bool, elem: int = 2) -> float:
    """Predicted GPU time of eager's dense FFN at decode sizes (weight bytes at DENSE_GBPS)."""
    return DENSE_FIXED_US + 1e-3 * elem * n * (k * (2 if gated else 1) + k_out) / DENSE_GBPS


def dense_host_bound(k: int, n: int, k_out: int, gated: bool, elem: int = 2) -> bool:
    """Whether the op's dense path at decode sizes takes less GPU time than its calls take host
    time (OP_DENSE_HOST_US): then replaying it from a CUDA graph (kernels/decode_graphs.py)
    saves time. K=4096, N=11008 (~88 us predicted): graphed 0.098 ms per call at M=1 against
    0.18-0.47 ungraphed on a slow host moment, 0.103 vs 0.099 at M=64 on a fast one
    (session11/run10, run12)."""
    return dense_us(k, n, k_out, gated, elem) < OP_DENSE_HOST_US


def decode_form(density: float, m: int, k: int, n: int, k_out: int,
                forms: Optional[tuple[str, ...]] = None) -> str:
    """The decode path's up/down form predicted fastest (cuda_decode.FORMS; only ``forms``
    if given)."""
    t = _forms_us(density, m, k, n, k_out, forms)
    return min(t, key=t.get)


def decode_wins(density: float, m: int, k: int, n: int, k_out: int, gated: bool,
                forms: Optional[tuple[str, ...]] = None) -> bool:
    return decode_pick(density, m, k, n, k_out, gated, forms) is not None


def twell_wins(density: float, gated: bool, k: int, n: int, k_out: int, itemsize: int) -> bool:
    """The density rule (rule 2) for a layer with weights W_g, W_u [n, k], W_d [k_out, n]."""
    g = 1.0 if gated else 0.0
    gathered = n * (k * g + k_out) * itemsize            # W_u and W_d^T rows, one per pair
    pair = PAIR_UNITS if gathered <= L2_BYTES else PAIR_UNITS_HBM
    return GATE_UNITS + pair * density * (1 + g) / 2 < MARGIN * (2 + g)


@dataclass
class _Layer:
    density: Optional[float] = None        # latest landed measurement
    calls: int = 0
    pending: Optional[tuple[torch.cuda.Event, Tensor, int]] = None  # (event, pinned, elements)
    host: Optional[Tensor] = field(default=None, repr=False)


_lock = threading.Lock()
_layers: dict[tuple, _Layer] = {}      # by (op instance, key)
_scope = threading.local()


def enter(instance: int) -> int:
    """Make ``instance`` the op instance whose state the calls below read and write (dispatch
    does, around each op call); returns the previous one, to restore."""
    prev = getattr(_scope, "instance", 0)
    _scope.instance = instance
    return prev


def instance() -> int:
    """The op instance of the call in progress (0 outside one, or for direct calls)."""
    return getattr(_scope, "instance", 0)


def _state(key: tuple) -> _Layer:
    full = (getattr(_scope, "instance", 0), key)
    st = _layers.get(full)
    if st is None:
        with _lock:
            st = _layers.setdefault(full, _Layer())
    return st


def _poll(st: _Layer) -> None:
    if st.pending is not None:
        event, pinned, elements = st.pending
        if event.query():
            st.density = float(pinned[0]) / max(elements, 1)
            st.pending = None


def poll(key: tuple) -> None:
    """Take the layer's measurement if it has landed. Never syncs; not under capture."""
    if not torch.cuda.is_current_stream_capturing():
        _poll(_state(key))


def use_twell(key: tuple, gated: bool, k: int, n: int, k_out: int, itemsize: int) -> bool:
    """True: run TwELL this call. Never syncs."""
    st = _state(key)
    if not torch.cuda.is_current_stream_capturing():
        _poll(st)
    return st.density is not None and twell_wins(st.density, gated, k, n, k_out, itemsize)


def use_decode(key: tuple, m: int, k: int, n: int, k_out: int, gated: bool) -> Optional[str]:
    """None: run dense this call; else run the decode path in the returned up/down form
    (before the first measurement: as at density 0). Never syncs. Under
    ``torch.use_deterministic_algorithms(True)`` only the forms without atomics
    (DETERMINISTIC_FORMS: fixed summation order, the same bits every call) are considered."""
    st = _state(key)
    if not torch.cuda.is_current_stream_capturing():
        _poll(st)
    d = 0.0 if st.density is None else st.density
    forms = DETERMINISTIC_FORMS if torch.are_deterministic_algorithms_enabled() else None
    return decode_pick(d, m, k, n, k_out, gated, forms)


def wants_probe(key: tuple, twell: bool, every: Optional[int] = None) -> bool:
    """Whether this call should measure the layer's density (cheap for TwELL, one pass dense).
    ``every``: probe interval in calls (default REFRESH_EVERY / PROBE_EVERY by path); one
    probe is in flight at a time."""
    st = _state(key)
    if torch.cuda.is_current_stream_capturing() or st.pending is not None:
        return False
    every = every or (REFRESH_EVERY if twell else PROBE_EVERY)
    return st.density is None or st.calls % every == 0


def tick(key: tuple) -> None:
    _state(key).calls += 1


def submit(key: tuple, nnz: Tensor, elements: int) -> None:
    """Start the async readback of a 0-d non-zero count covering ``elements`` entries."""
    st = _state(key)
    if st.host is None:
        st.host = torch.empty(1, dtype=torch.float64, pin_memory=True)
    st.host.copy_(nnz.reshape(1).to(torch.float64), non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    st.pending = (event, st.host, elements)


def density(key: tuple) -> Optional[float]:
    """Latest landed density of a layer (None before the first measurement lands)."""
    return _state(key).density


def reset() -> None:
    """Forget every layer's measurements, of every op instance."""
    with _lock:
        _layers.clear()
