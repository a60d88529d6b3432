"""Which kernel runs: the one home of every rule. What each path can take comes from the
capability table (``paths.py``), constants from ``arch.py``'s records.

Per call, ``plan_infer`` / ``plan_train`` return a plan (path, its sizing, whether to measure
density); ``static_reason`` is their compile-time twin, used by the graph pass (fuse_ffn),
``prepare`` and the backend: why a rewritten FFN would surely run a path slower than
Inductor's, or None. ``path=`` forces a path (tests, benchmarks, ``twell.path``); a forced
path that cannot run the call raises ``ValueError``.

Inference, CUDA bf16/fp16 (fp32 runs eager's dense calls: tl.dot would round its operands to
tf32, about 3e-4 relative error, over twice eager fp32's):
  1. Shapes. Decode path for 1 <= M <= decode_max_m tokens; per-row TwELL path for
     M >= min_tokens (graphs_min_tokens, where set, for calls inside CUDA graphs: capturing,
     or an op compiled for them, density.in_graphs; compile time: static_reason's
     ``cudagraphs``), min_width <= K, K and K_out <= MAX_WIDTH (the row kernel holds a whole x
     and y row in registers), N <= MAX_N (16-bit columns in the per-row lists). Dense otherwise.
  2. Density (per layer, lagged; density.py). With d the measured density and g = 1 for a gated
     FFN, the layer runs TwELL while, in units of one dense M x K x N GEMM,
         gate_units + pair_units * d * (1 + g) / 2  <  margin * (2 + g)
     (cuBLAS gate + compaction + the row kernel vs the dense FFN); pair_units_hbm replaces
     pair_units when W_u and W_d together exceed l2_bytes; under min_tokens (inside CUDA graphs
     only) graphs_margin, where set, replaces margin. A layer starts dense (a probe call);
     dense layers re-probe every probe_every calls, TwELL layers every refresh_every. The
     density also sets the per-row list width (``list_width``).
  3. Decode (M <= decode_max_m, same key and measurement): one predicted time per up/down
     form (``decode_us``; u = 1-(1-d)^R the expected fraction of neurons active in some row of
     an R-row block, B row blocks, BN / LBN neurons per program):
       tiles:  fixed + B bytes(W_g) / rate + add * R B N_a K_out / 1e6 + entry * u N B (K + K_out) / 4096
               (N_a = N / BN (1 - (1-u)^BN) blocks with an active neuron)
       rows:   fixed + bytes(W_g) / rate + step * u BN (K + M_P K_out) / 4096    (M <= vec_m)
       list:   fixed + B bytes(W_g) / rate + pair * d R LBN K / 4096 + entry * d N K_out / 4096
       pairs:  fixed + B bytes(W_g) / rate + trip * d R B LBN / PB (K + K_out) / 4096
     each plus a strided term (W_down^T rows read through W_down's transposed view, a 32 B
     sector per element of the union). The fastest form runs while its time is under
     decode_margin x (dense_fixed_us + bytes(W_g + W_u + W_d) / dense_gbps). Under
     ``torch.use_deterministic_algorithms(True)`` only the list form (no atomics) is considered.
     Before the first measurement lands the rule is evaluated at density 0, the best case (a
     CUDA graph recorded on the second call would otherwise keep dense forever).
  4. A dense call at decode sizes replays the op's own CUDA graph where eager's calls take more
     host time (op_dense_host_us) than their GPU time (``dense_host_bound``), past them where its
     GEMMs' modeled time (``dense_gemms_us``) is under op_dense_prefill_host_us; a per-row call
     likewise where its modeled GPU time (rule 2's units times one GEMM at gemm_tflops,
     ``rows_us``) is under op_rows_host_us (``rows_host_bound``). Statistics and the probe's
     count are taken inside the graph.
  5. A per-row call splits its heaviest rows (the record's row_split, ``splits_rows``) where the
     layer's latest probe saw a row over row_split_pairs non-zeros and over row_split_skew times
     the mean, in calls of at most row_split_max_m tokens: the split kernel costs the rows it
     does not split, so skew must be measured, not assumed.
Inference, CPU: the C++ kernel (cpu_ffn.py) for fp32/bf16 from min_tokens tokens at K >=
min_width (it picks sparse or dense up/down inside, from the non-zeros it counts); plain PyTorch
(eager's calls) otherwise.
Training, CUDA bf16/fp16 within the kernels' widths: from train_min_tokens tokens and K >=
train_min_width (and a dense backup smaller than M) the sparse kernels while the lagged density
is under sparse_max_density; else eager's GEMMs saving the compact state (while no rows were lost past
the backup) or g and u. Rows past the backup count lost_row_pairs pairs each in the probe.
fp32 and the CPU train on plain PyTorch (hybrid format, exact).

Compile time (``static_reason``), leaving an FFN to Inductor: CUDA fp32; static token counts
in the band between the decode and per-row paths; decode sizes without CUDA graphs (host-bound:
docs/design-notes/decode.md); decode sizes where even density 0 cannot win;
layers too wide or too narrow for the per-row kernels; CPU FFNs under the C++ kernel's token
count or width, or in a dtype it lacks; training without an L1 penalty under train_min_tokens, in fp32, or on
the CPU. A dynamic token count is answered as its current value is, under a guard on its range
(the graph then serves that range; another range recompiles once); a user's range
(``mark_dynamic(min=, max=)``) is never narrowed.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, NamedTuple, Optional, Union

import torch
from torch import Tensor

from twell_compile.formats import backup_capacity, ell_width_for
from twell_compile.runtime import arch, decode_graphs, density, paths
from twell_compile.runtime.arch import CpuPolicy, GpuPolicy
# MAX_WIDTH, MAX_N (the kernels' width limits) are read here by tests and benchmarks
from twell_compile.runtime.paths import (DETERMINISTIC_FORMS, INFER_PATHS, MAX_N, MAX_WIDTH,  # noqa: F401
                                         TRAIN_PATHS, Path)

# Each path's record in the capability table (runtime/paths.py): what the rules below check.
_ROWS = paths.caps(Path.TWELL, training=False)
_DECODE = paths.caps(Path.DECODE, training=False)
_CPU = paths.caps(Path.CPU, training=False)
_DENSE = paths.caps(Path.DENSE, training=False)
_TRAIN = paths.caps(Path.DENSE, training=True)          # the training kernels' limits
_TRAIN_SPARSE = paths.caps(Path.TWELL, training=True)


# --------------------------------------------------------------------------- cost models
def twell_units(p: GpuPolicy, d: float, gated: bool, k: int, n: int, k_out: int, itemsize: int) -> float:
    """The per-row path's modeled cost, in units of one dense M x K x N GEMM, for a layer with
    weights W_g, W_u [n, k], W_d [k_out, n] at density d."""
    g = 1.0 if gated else 0.0
    gathered = n * (k * g + k_out) * itemsize            # W_u and W_d^T rows, one per pair
    pair = p.pair_units if gathered <= p.l2_bytes else p.pair_units_hbm
    return p.gate_units + pair * d * (1 + g) / 2


def twell_wins(p: GpuPolicy, d: float, gated: bool, k: int, n: int, k_out: int, itemsize: int,
               m: Optional[int] = None) -> bool:
    """Rule 2: the per-row path's units under the margin times dense's (2 or 3 GEMMs); for ``m``
    tokens under min_tokens (the band the graphs bound opens) the record's graphs_margin, where
    set: the units were fitted above it, and overpredict the per-row path's speed there."""
    margin = p.margin
    if m is not None and p.graphs_margin and m < paths.token_range(_ROWS, p)[0]:
        margin = p.graphs_margin
    return twell_units(p, d, gated, k, n, k_out, itemsize) < margin * (3 if gated else 2)


def gemm_us(p: GpuPolicy, m: int, k: int, n: int) -> float:
    """Modeled GPU time (us) of one dense m x k x n GEMM at the record's gemm_tflops."""
    return 2e-6 * m * k * n / p.gemm_tflops


def rows_us(p: GpuPolicy, d: float, m: int, k: int, n: int, k_out: int, gated: bool, itemsize: int = 2) -> float:
    """Modeled GPU time of a per-row call on m tokens: its units times one dense m x k x n GEMM."""
    return twell_units(p, d, gated, k, n, k_out, itemsize) * gemm_us(p, m, k, n)


def splits_rows(p: GpuPolicy, m: int, d: Optional[float], peak: Optional[float], n: int) -> bool:
    """Rule 5: whether a per-row call on ``m`` tokens splits its heaviest rows, from the layer's
    latest probe (density ``d``, its heaviest row's non-zeros ``peak``; None: not measured, no
    split)."""
    if p.row_split < 2 or d is None or peak is None or (p.row_split_max_m and m > p.row_split_max_m):
        return False
    return peak > p.row_split_pairs and peak > p.row_split_skew * d * n


def rows_host_bound(p: GpuPolicy, d: float, m: int, k: int, n: int, k_out: int, gated: bool,
                    itemsize: int = 2) -> bool:
    """Whether a per-row call's GPU time is under the host time its eager launches take in a
    compiled module (op_rows_host_us): then replaying it from the op's own CUDA graph saves time
    (non-gated, 8192 tokens: 403 us modeled, eager 0.48-0.68 ms per call, graphed 0.45, H200)."""
    return rows_us(p, d, m, k, n, k_out, gated, itemsize) < p.op_rows_host_us


def list_width(p: GpuPolicy, n: int, nnz_per_row: Optional[float] = None) -> int:
    """Per-row list width W: a power of two >= 4x the mean non-zeros per row + 32 (tail 0.2,
    mean 51: W=128 left 10% of rows over it, 1.33 vs ~0.9 ms on H200), within [list_min,
    list_max] and pow2(N). Rows over W stay exact (the row kernel's tail over g), only slower."""
    w = p.list_min if nnz_per_row is None else arch.next_pow2(int(4 * nnz_per_row) + 32)
    return max(1, min(max(w, p.list_min), p.list_max, arch.next_pow2(n)))


def union_fraction(d: float, m: int) -> float:
    """Expected fraction of neurons active in at least one of m rows (independent rows)."""
    d = min(max(float(d), 0.0), 1.0)
    return 1.0 - (1.0 - d) ** m


def tiles_active(u: float, n: int, bn: int) -> float:
    """Expected neuron blocks of BN with an active neuron when a fraction u of N is active."""
    return n / bn * (1.0 - (1.0 - u) ** bn)


def decode_terms(p: GpuPolicy, d: float, u: Optional[float], m: int, k: int, n: int,
                 k_out: int) -> dict[str, list[float]]:
    """Per decode form the terms of its predicted time for M rows (rule 3, each without its
    constant): 1, bytes(W_g) in MB, the form's work terms, the strided term; "rows" only where
    M <= vec_m. ``u``: fraction of neurons active in some row of a row block (measured where
    fitted; None: union_fraction's expectation)."""
    c = p.decode_config(m, k)
    mb = min(arch.m_pad(min(m, arch.MAX_M)), arch.MAX_MB)
    rows, blocks = min(m, mb), -(-m // mb)
    d = min(max(float(d), 0.0), 1.0)
    if u is None:
        u = union_fraction(d, rows)
    gate_mb = 2e-6 * n * k * blocks
    strided_mb = 32e-6 * u * n * blocks * k_out       # a sector per W_down element of the union
    out = {
        "tiles": [1.0, gate_mb, rows * blocks * tiles_active(u, n, c.bn) * k_out / 1e6,
                  u * n * blocks * (k + k_out) / 4096],
        "list": [1.0, gate_mb, d * rows * c.lbn * k / 4096, d * n * k_out / 4096],
        "pairs": [1.0, gate_mb, d * rows * blocks * arch.pairs_bn(c) / arch.pairs_pb(c) * (k + k_out) / 4096],
    }
    if m <= c.vec_m:
        out["rows"] = [1.0, gate_mb, u * arch.rows_bn(m, c) * (k + arch.m_pad_rows(m) * k_out) / 4096]
    for terms in out.values():
        terms.append(strided_mb)
    return out


def decode_us(p: GpuPolicy, d: float, m: int, k: int, n: int, k_out: int) -> dict[str, float]:
    """Predicted decode time (us) of each form for M rows: decode_terms times the record's
    per-form constants (the second is a rate: its term is bytes(W_g) in MB, 1e3 / GB/s)."""
    out = {}
    for form, t in decode_terms(p, d, None, m, k, n, k_out).items():
        c = p.decode_forms[form]
        out[form] = c[0] + 1e3 * t[1] / c[1] + sum(ci * ti for ci, ti in zip(c[2:], t[2:]))
    return out


def dense_us(p: GpuPolicy, k: int, n: int, k_out: int, gated: bool, elem: int = 2) -> float:
    """Predicted GPU time of eager's dense FFN at decode sizes (weight bytes at dense_gbps)."""
    return p.dense_fixed_us + 1e-3 * elem * n * (k * (2 if gated else 1) + k_out) / p.dense_gbps


def dense_gemms_us(p: GpuPolicy, m: int, k: int, n: int, k_out: int, gated: bool) -> float:
    """Modeled GPU time of eager's dense FFN on m tokens: its GEMMs (1 or 2 of m x k x n, and
    m x n x k_out; ``gemm_us``)."""
    return (2 if gated else 1) * gemm_us(p, m, k, n) + gemm_us(p, m, n, k_out)


def dense_host_bound(p: GpuPolicy, k: int, n: int, k_out: int, gated: bool, elem: int = 2) -> bool:
    """Whether the op's dense path at decode sizes takes less GPU time than its eager calls take
    host time: then replaying it from the op's own CUDA graph saves time (K=4096, N=11008,
    ~88 us predicted: graphed 0.098 ms per call at M=1 against 0.18-0.47 ungraphed, H200)."""
    return dense_us(p, k, n, k_out, gated, elem) < p.op_dense_host_us


def _forms(forms: Optional[tuple[str, ...]], t: dict[str, float]) -> dict[str, float]:
    return t if forms is None else {f: v for f, v in t.items() if f in forms}


def decode_form(p: GpuPolicy, d: float, m: int, k: int, n: int, k_out: int,
                forms: Optional[tuple[str, ...]] = None) -> str:
    """The decode form predicted fastest (only ``forms`` if given)."""
    t = _forms(forms, decode_us(p, d, m, k, n, k_out))
    return min(t, key=t.get)


def decode_pick(p: GpuPolicy, d: float, m: int, k: int, n: int, k_out: int, gated: bool,
                forms: Optional[tuple[str, ...]] = None) -> Optional[str]:
    """The fastest form when it beats decode_margin x dense's predicted time, else None."""
    t = _forms(forms, decode_us(p, d, m, k, n, k_out))
    form = min(t, key=t.get)
    return form if t[form] < p.decode_margin * dense_us(p, k, n, k_out, gated) else None


def decode_wins(p: GpuPolicy, d: float, m: int, k: int, n: int, k_out: int, gated: bool,
                forms: Optional[tuple[str, ...]] = None) -> bool:
    return decode_pick(p, d, m, k, n, k_out, gated, forms) is not None


# --------------------------------------------------------------------------- per call
class InferPlan(NamedTuple):
    """How one inference call runs.

    path: "dense" (eager's calls), "decode", "twell" (per-row TwELL), "cpu" (the C++ kernel)
    or "torch" (plain PyTorch). key: the layer's density-state key ("" paths without state).
    form: the decode form. width: the per-row list width. probe: measure the layer's density
    this call. graphed: the dense or per-row call replayed from the op's own CUDA graph.
    tick: count the call in the layer's state. every: the probe interval in calls (plans with
    a key). split: the per-row call splits its heaviest rows (rule 5).
    """
    path: str
    policy: Union[GpuPolicy, CpuPolicy, None] = None
    key: tuple = ()
    form: str = ""
    width: int = 0
    probe: bool = False
    graphed: bool = False
    tick: bool = False
    every: int = 0
    split: bool = False


def _can_run(c: paths.Caps, x: Tensor) -> bool:
    """x's device and dtype are the record's and what it needs is present (dtype first: the
    C++ CPU kernel builds on first ask)."""
    return paths.runs_on(c, x.device.type) and paths.dtype_ok(c, x.dtype) and all(map(paths.have, c.needs))


def _refuse(path: str, why: str) -> ValueError:
    return ValueError(f"path={path!r} cannot run this call: {why} (path='auto' chooses for itself)")


def check_path(path: str, allowed: tuple[str, ...], what: str) -> None:
    """ValueError unless ``path`` names a path of the ``what`` op."""
    if path not in allowed:
        raise ValueError(f"path must be one of {allowed} for the {what} op, got {path!r}")


def _graphs_usable(x: Tensor) -> bool:
    """Whether a call may replay the op's own graph at all: decode_graphs usable for x, and not
    under torch.use_deterministic_algorithms (cuBLAS may pick another kernel inside a capture
    than eagerly, and the bits would change between calls)."""
    return decode_graphs.usable(x) and not torch.are_deterministic_algorithms_enabled()


def _graph_dense(p: GpuPolicy, x: Tensor, m: int, k: int, n: int, k_out: int, gated: bool) -> bool:
    """Whether a dense call replays the op's own graph: where eager's calls are host-bound, at
    decode sizes (dense_host_bound) and past them (dense_gemms_us under op_dense_prefill_host_us)."""
    if m <= paths.token_range(_DECODE, p)[1]:
        bound = dense_host_bound(p, k, n, k_out, gated, x.element_size())
    else:
        bound = dense_gemms_us(p, m, k, n, k_out, gated) < p.op_dense_prefill_host_us
    return bound and _graphs_usable(x)


def _graph_rows(p: GpuPolicy, x: Tensor, m: int, d: Optional[float], n: int, k_out: int, gated: bool) -> bool:
    """Whether a per-row call replays the op's own graph: where its eager calls' host time
    exceeds their GPU time (rows_host_bound; density 0 before one is measured)."""
    return (rows_host_bound(p, d or 0.0, m, x.shape[-1], n, k_out, gated, x.element_size())
            and _graphs_usable(x))


def plan_infer(x: Tensor, n: int, k_out: int, gated: bool, layer: str, path: str = "auto") -> InferPlan:
    """The plan for one ``twell::ffn`` call on x [..., K] with N hidden units and K_out outputs.
    Reads the layer's lagged density (never syncs). Eligibility is the capability table's
    (runtime/paths.py): a forced path's record refuses or runs the call; "auto" runs a path
    where its record and the record's measured bounds take the call."""
    check_path(path, INFER_PATHS, "inference")
    c = paths.caps(path, training=False)
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    if path == Path.TORCH or (0 in (k, n, k_out) and not c.nonzero):
        return InferPlan("torch")           # a width of 0: eager's calls (y is b_down, or zeros, at N=0)
    if 0 in (k, n, k_out):
        raise _refuse(path, f"a width of 0 (K={k}, N={n}, K_out={k_out})")
    if path != Path.AUTO:
        sized = c.max_m_from and paths.runs_on(c, x.device.type)     # a limit of the record's decode config
        why = paths.refusal(c, x.device, x.dtype, m, k, n, k_out, arch.policy_for(x.device) if sized else None)
        if why is not None:
            raise _refuse(path, why)
    if x.device.type == "cpu":
        p = arch.policy_for(x.device)
        if path == Path.CPU or (paths.auto_ok(_CPU, p, x.dtype, m, k, n, k_out) and _can_run(_CPU, x)):
            return InferPlan("cpu", p)
        return InferPlan("torch")
    if not _can_run(_DENSE, x):            # eager's calls need the relu pass's kernel (Triton) on CUDA
        return InferPlan("torch")
    p = arch.policy_for(x.device)
    key = (layer, x.device, x.dtype, k, n, k_out, gated)
    if c.runs == "dense":       # eager's calls, replayed from the op's graph where host-bound
        return InferPlan("dense", p, graphed=_graph_dense(p, x, m, k, n, k_out, gated))
    if c.runs == "decode":
        d = density.poll(key) or 0.0
        form = c.form or decode_form(
            p, d, m, k, n, k_out, DETERMINISTIC_FORMS if torch.are_deterministic_algorithms_enabled() else None)
        return InferPlan("decode", p, key, form=form, probe=density.wants_probe(key, p.refresh_every), tick=True,
                         every=p.refresh_every)
    if c.runs == "twell":
        return _rows_plan(p, x, key, m, n, k_out, gated, density.poll(key),
                          density.wants_probe(key, p.refresh_every), p.refresh_every)
    # auto
    decode = paths.auto_ok(_DECODE, p, x.dtype, m, k, n, k_out)
    form = None
    if decode:
        d = density.poll(key)
        forms = DETERMINISTIC_FORMS if torch.are_deterministic_algorithms_enabled() else None
        form = decode_pick(p, 0.0 if d is None else d, m, k, n, k_out, gated, forms)
        decode = form is not None or decode_wins(p, 0.0, m, k, n, k_out, gated)
    # inside CUDA graphs (capturing, or an op compiled for them) the record's bound for graphs
    rows_ok = paths.auto_ok(_ROWS, p, x.dtype, m, k, n, k_out, density.in_graphs())
    if not decode and not rows_ok:
        # eager's calls (fp32, M between the sparse paths, unsupported shapes): no bookkeeping
        return InferPlan("dense", p, graphed=_graph_dense(p, x, m, k, n, k_out, gated))
    if decode:
        sparse = form is not None
    else:
        d = density.poll(key)
        sparse = d is not None and twell_wins(p, d, gated, k, n, k_out, x.element_size(), m)
    every = p.refresh_every if sparse else p.probe_every
    probe = density.wants_probe(key, every)
    if sparse and decode:
        return InferPlan("decode", p, key, form=form, probe=probe, tick=True, every=every)
    if sparse:
        return _rows_plan(p, x, key, m, n, k_out, gated, d, probe, every)
    return InferPlan("dense", p, key, probe=probe, graphed=_graph_dense(p, x, m, k, n, k_out, gated), tick=True,
                     every=every)


def _rows_plan(p: GpuPolicy, x: Tensor, key: tuple, m: int, n: int, k_out: int, gated: bool, d: Optional[float],
               probe: bool, every: int) -> InferPlan:
    """A per-row TwELL plan: its list width from the layer's density ``d`` (None: none measured)."""
    return InferPlan("twell", p, key, width=list_width(p, n, None if d is None else d * n), probe=probe, tick=True,
                     graphed=_graph_rows(p, x, m, d, n, k_out, gated), every=every,
                     split=splits_rows(p, m, d, density.peak(key), n))


class TrainPlan(NamedTuple):
    """How one training forward runs. path: "twell" (sparse kernels), "dense" (eager's GEMMs
    saving g and u), "compact" (eager's GEMMs saving the compact hybrid state) or "torch"
    (plain PyTorch). key / lost_key: the layer's density and lost-row state. probe: measure
    them this call. tick: count the call. width / cap: the ELL width and dense-backup rows."""
    path: str
    policy: Optional[GpuPolicy] = None
    key: tuple = ()
    lost_key: tuple = ()
    probe: bool = False
    tick: bool = False
    width: int = 0
    cap: int = 0


def cuda_train_supported(x: Tensor, n: int, k_out: int) -> bool:
    """The CUDA training kernels take this call (their record: bf16/fp16 CUDA with Triton,
    within widths)."""
    return _can_run(_TRAIN, x) and paths.fits_widths(_TRAIN, x.shape[-1], n, k_out)


def plan_train(x: Tensor, n: int, k_out: int, gated: bool, ell_width: int, backup_rows: int,
               layer: str, path: str = "auto") -> TrainPlan:
    """The plan for one ``twell::ffn_train`` forward. Inside a backward pass (activation
    checkpointing's recompute) the measurements are not polled, so the recompute takes the path
    its forward took and saves tensors of the same shapes (non-reentrant checkpointing checks)."""
    check_path(path, TRAIN_PATHS, "training")
    c = paths.caps(path, training=True)
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    if not cuda_train_supported(x, n, k_out):
        if path != Path.AUTO:
            why = paths.refusal(c, x.device, x.dtype, m, k, n, k_out)
            raise _refuse(path, f"{why}; this call trains on plain PyTorch")
        return TrainPlan("torch")
    p = arch.policy_for(x.device)
    width = ell_width_for(ell_width, n)
    cap = int(backup_capacity(m, backup_rows))
    key = ("train", layer, x.device, x.dtype, k, n, k_out, gated)
    lkey = ("train-lost",) + key[1:]
    compact_ok = cap < m                    # a compact state needs a backup smaller than M
    if path != Path.AUTO:
        if c.backup and not compact_ok:
            raise _refuse(path, f"{m} tokens fit the dense backup ({cap} rows, backup_rows={backup_rows}); "
                                  "the sparse and compact states need more tokens than backup rows")
        if not paths.lists_fit(c, m, width):
            raise _refuse(path, f"{m} tokens x lists of width {width} (to a power of 2) reach the sparse "
                                  f"backward's 32-bit entry codes ({paths.MAX_LIST_SLOTS}); split the batch, "
                                  "or a narrower twell.ell_width")
        return TrainPlan(c.runs, p, key, lkey, probe=density.wants_probe(key, p.train_probe_every),
                         tick=compact_ok, width=width, cap=cap)
    if not (paths.in_range(_TRAIN_SPARSE, p, m) and compact_ok) or torch.are_deterministic_algorithms_enabled():
        # (deterministic mode: eager's path; the sparse and compact states use atomic counters)
        return TrainPlan("dense", p, key, lkey, width=width, cap=cap)
    if torch._C._current_graph_task_id() == -1:      # not in a backward
        density.poll(key)
        density.poll(lkey)
    d, lost = density.measured(key), density.measured(lkey)
    sparse = (d is not None and d < p.sparse_max_density and k >= paths.min_width(_TRAIN_SPARSE, p)
              and paths.lists_fit(_TRAIN_SPARSE, m, width))
    compact = not sparse and lost is not None and lost <= p.compact_max_lost
    return TrainPlan("twell" if sparse else "compact" if compact else "dense", p, key, lkey,
                     probe=density.wants_probe(key, p.train_probe_every), tick=True, width=width, cap=cap)


# --------------------------------------------------------------------------- compile time
def _sym_lt(m: torch.SymInt, limit: int) -> Optional[bool]:
    """m < limit for a backed SymInt token count: from its value range where that decides it
    (no guard); else guarded (the graph then serves that side only) when every symbol in m is
    unbounded above; else None. A finite bound is a user's range (mark_dynamic(min=, max=)),
    which a narrowing guard would turn into a ConstraintViolationError."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    from torch.utils._sympy.numbers import int_oo

    if statically_known_true(m < limit):
        return True
    if statically_known_true(m >= limit):
        return False
    env = m.node.shape_env
    if any(env.var_to_range.get(s) is None or env.var_to_range[s].upper != int_oo
           for s in m.node.expr.free_symbols):
        return None
    return bool(m < limit)


def _guarded(m: torch.SymInt, where: str, why: Optional[str]) -> Optional[str]:
    """A static count's reason, told for a dynamic count whose graph is guarded to ``where``."""
    return why and (f"dynamic token count {m}, {int(m.node.hint)} now; this graph is guarded to {where} "
                    f"tokens (another range recompiles once): {why}")


def _cuda_count_reason(p: GpuPolicy, m: int, k: int, n: int, k_out: int, gated: bool,
                       cudagraphs: bool) -> Optional[str]:
    """The CUDA inference rules on a static token count (bf16/fp16): the decode and per-row
    records' token ranges and widths."""
    decode_max = paths.token_range(_DECODE, p)[1]
    rows_min = paths.token_range(_ROWS, p, cudagraphs)[0]
    if decode_max < m < rows_min:
        return (f"{m} tokens: above the decode path's {decode_max} and below the per-row path's "
                f"{rows_min}, where the CUDA sparse kernels lose to dense")
    if paths.in_range(_DECODE, p, m) and not cudagraphs:
        return (f"{m} tokens without CUDA graphs: the step is host-bound, and with these FFNs "
                f"rewritten generate() ran 0.63x of Inductor's speed at batch 1 (H200); compile with "
                f"mode='reduce-overhead', or set twell.cudagraphs='on' if you capture CUDA graphs yourself")
    if paths.in_range(_DECODE, p, m) and not decode_wins(p, 0.0, m, k, n, k_out, gated):
        return (f"{m} tokens: the CUDA decode path's cost model ({p.name}) has dense faster for this "
                f"layer even at density 0")
    if paths.in_range(_ROWS, p, m, cudagraphs) and paths.too_wide(_ROWS, k, n, k_out):
        return f"layer too wide for the CUDA sparse kernels (K={k}, K_out={k_out}, N={n})"
    if paths.in_range(_ROWS, p, m, cudagraphs) and k < paths.min_width(_ROWS, p):
        return (f"K={k}: below the {paths.min_width(_ROWS, p)} where the CUDA per-row kernels beat dense at "
                f"{m} tokens ({p.name})")
    return None


def _cuda_infer_reason(p: GpuPolicy, dtype: torch.dtype, m, k: int, n: int, k_out: int, gated: bool,
                       cudagraphs: bool) -> Optional[str]:
    if not (paths.dtype_ok(_ROWS, dtype) or paths.dtype_ok(_DECODE, dtype)):
        return (f"{str(dtype).replace('torch.', '')} on CUDA runs dense (the sparse kernels take "
                f"{paths.dtype_names(_ROWS)})")
    if isinstance(m, torch.SymInt):
        decode_max = paths.token_range(_DECODE, p)[1]
        rows_min = paths.token_range(_ROWS, p, cudagraphs)[0]
        decode = _sym_lt(m, decode_max + 1) if m.node.has_hint() else None
        band = _sym_lt(m, rows_min) if decode is False else False
        if decode is None or band is None:
            return None                  # unbacked, or a user's range spans two ranges: the op decides
        where = (f"<= {decode_max}" if decode else f"{decode_max + 1}-{rows_min - 1}" if band
                 else f">= {rows_min}")
        return _guarded(m, where, _cuda_count_reason(p, int(m.node.hint), k, n, k_out, gated, cudagraphs))
    return None if m is None else _cuda_count_reason(p, m, k, n, k_out, gated, cudagraphs)


def _cpu_infer_reason(p: CpuPolicy, dtype: torch.dtype, m, k: int, n: int, k_out: int) -> Optional[str]:
    if not paths.dtype_ok(_CPU, dtype):
        return (f"{str(dtype).replace('torch.', '')} on CPU runs plain PyTorch (the C++ kernel takes "
                f"{paths.dtype_names(_CPU)}), slower than Inductor's code")
    if k < paths.min_width(_CPU, p):
        return (f"K={k}: under the K >= {paths.min_width(_CPU, p)} where the CPU kernel beats Inductor (narrower "
                f"layers: Inductor's dense code is faster)")
    few_below = paths.token_range(_CPU, p)[0]

    def few(count: int) -> str:
        return (f"{count} tokens: under the {few_below} from which the CPU kernel beats Inductor (plain "
                f"PyTorch is slower than Inductor)")

    if isinstance(m, torch.SymInt):
        if m.node.has_hint() and _sym_lt(m, few_below):
            return _guarded(m, f"< {few_below}", few(int(m.node.hint)))
        return None
    if m is None:
        return None                      # unknown count (prepare): the op decides per call
    if m < few_below:
        return few(m)
    if not all(map(paths.have, _CPU.needs)):
        from twell_compile.runtime import cpu_ffn       # builds on first use; not at import

        return f"the C++ CPU kernel is unavailable ({cpu_ffn.active_impl()}); plain PyTorch is slower than Inductor"
    return None


def _static_policy(device: torch.device) -> GpuPolicy:
    """The CUDA record compile-time rules read: the device's own where CUDA is available, else
    the default (arch.cuda_default: no GPU to ask, e.g. CI)."""
    return arch.policy_for(device) if torch.cuda.is_available() else arch.cuda_default()  # type: ignore[return-value]


def _train_reason(device: torch.device, dtype: torch.dtype, m, k: int, n: int, k_out: int) -> Optional[str]:
    """The sparse training kernels' record: device, dtype, widths, the record's K and token bounds."""
    if not paths.runs_on(_TRAIN_SPARSE, device.type):
        return ("training on CPU runs the plain-PyTorch implementation (exact, slower than Inductor's "
                "code); set twell.l1 to train with the sparsity penalty, which needs it")
    p = _static_policy(device)
    if not paths.dtype_ok(_TRAIN_SPARSE, dtype):
        return (f"{str(dtype).replace('torch.', '')} training on CUDA runs the plain-PyTorch path "
                f"(the sparse training kernels take {paths.dtype_names(_TRAIN_SPARSE)}, e.g. under autocast)")
    if paths.too_wide(_TRAIN_SPARSE, k, n, k_out):
        return f"layer too wide for the CUDA sparse training kernels (K={k}, K_out={k_out}, N={n})"
    min_k = paths.min_width(_TRAIN_SPARSE, p)
    if k < min_k:
        return (f"K={k}: under the {min_k} where the CUDA sparse training kernels can win "
                f"(no twell.l1 penalty needs our backward)")
    min_m = paths.token_range(_TRAIN_SPARSE, p)[0]

    def below(count: int) -> str:
        return (f"{count} tokens: below the {min_m} where the CUDA sparse training kernels "
                f"can win (no twell.l1 penalty needs our backward)")

    if isinstance(m, torch.SymInt):
        # guarded either way; None: unbacked, or a user's range spanning train_min_tokens
        if m.node.has_hint() and _sym_lt(m, min_m):
            return _guarded(m, f"< {min_m}", below(int(m.node.hint)))
        return None
    return below(m) if m is not None and m < min_m else None


_rules_for: list[tuple[torch.device, torch.dtype]] = []   # compile_rules_for blocks open, innermost last


@contextlib.contextmanager
def compile_rules_for(device: Union[str, torch.device], dtype: torch.dtype) -> Iterator[None]:
    """A scope in which the compile-time rules (``static_reason``, ``static_path``) answer as
    for FFNs on ``device`` in ``dtype``, whatever the traced tensors are: a CUDA compile's
    decisions on a machine without a GPU (tests, ``explain``). The ops still run on their
    tensors' own device; the per-call plan is unchanged."""
    _rules_for.append((torch.device(device), dtype))
    try:
        yield
    finally:
        _rules_for.pop()


def _rules_target(device: torch.device, dtype: torch.dtype) -> tuple[torch.device, torch.dtype]:
    return _rules_for[-1] if _rules_for else (torch.device(device), dtype)


def static_reason(device: torch.device, dtype: torch.dtype, m: Optional[Union[int, torch.SymInt]], k: int,
                  n: int, k_out: int, *, gated: bool = True, training: bool = False, l1: float = 0.0,
                  cudagraphs: bool = True, path: str = "auto", experts: int = 0) -> Optional[str]:
    """Why a rewritten FFN would surely run a path slower than Inductor's for these compile-time
    facts (``m``: token count, an int, a SymInt under dynamic shapes, None when unknown;
    ``experts``: the expert count of a grouped-experts block, 0 for one FFN), or None: rewrite
    it. A forced ``path`` always rewrites; so does training with an L1 penalty (it lives in our
    backward)."""
    if path != "auto":
        return None
    device, dtype = _rules_target(device, dtype)
    why = experts_reason(device, experts, training=training, l1=l1)
    if why is not None:
        return why
    if training:
        return None if l1 else _train_reason(device, dtype, m, k, n, k_out)
    if paths.runs_on(_DENSE, device.type):      # the CUDA paths' device
        p = _static_policy(device)
        return _cuda_infer_reason(p, dtype, m, k, n, k_out, gated, cudagraphs)
    if paths.runs_on(_CPU, device.type):
        return _cpu_infer_reason(arch.policy_for(device), dtype, m, k, n, k_out)  # type: ignore[arg-type]
    return None


def experts_reason(device: torch.device, experts: int, *, training: bool = False, l1: float = 0.0,
                   path: str = "auto") -> Optional[str]:
    """Why a grouped-experts block of ``experts`` experts would run slower on our ops than in its
    own grouped form (whatever its shapes), or None: on CUDA, unless a path is forced or an L1
    penalty needs our backward. static_reason's first rule; prepared experts modules ask it
    alone."""
    if path != "auto" or not experts or device.type != "cuda" or (training and l1):
        return None
    # execute.experts_infer / experts_train_forward: the routed offsets read on the host, then
    # one call of the single-FFN op per expert, against Inductor's one grouped_mm
    return (f"{experts} grouped experts run expert by expert on CUDA (a host read of the routing, one "
            f"launch sequence per expert): 0.67x of Inductor inference, 0.81x training (8 experts, 16384 "
            f"tokens, H200, results/h200/moe.json)")


def static_path(device: torch.device, dtype: torch.dtype, m: Optional[Union[int, torch.SymInt]], k: int,
                n: int, k_out: int, *, training: bool = False, path: str = "auto") -> str:
    """What a rewritten FFN's op will run, in words, for ``explain`` (compile-time facts, in
    ``static_reason``'s order; the final choice is per call). Adds no guard: a dynamic count is
    described, not decided."""
    device, dtype = _rules_target(device, dtype)
    if path != "auto":
        return f"forced: {path}"
    static_m = m if isinstance(m, int) else None
    if training:
        c = _TRAIN_SPARSE
        if paths.runs_on(c, device.type) and paths.dtype_ok(c, dtype) and not paths.too_wide(c, k, n, k_out):
            min_k = paths.min_width(c, _static_policy(device))
            if k < min_k:
                return f"CUDA dense training path (K={k} under the sparse kernels' {min_k})"
            return "CUDA sparse training kernels or dense, by measured density"
        return f"plain PyTorch (exact; the sparse training kernels take CUDA {paths.dtype_names(c)})"
    if paths.runs_on(_DENSE, device.type):
        if not (paths.dtype_ok(_DECODE, dtype) or paths.dtype_ok(_ROWS, dtype)):
            return "dense (eager's calls)"
        p = _static_policy(device)
        if static_m is not None and static_m <= paths.token_range(_DECODE, p)[1]:
            return "CUDA decode or dense, by measured density"
        if static_m is not None:
            return "CUDA TwELL or dense, by measured density"
        return "CUDA decode, TwELL or dense, by token count and measured density"
    if paths.runs_on(_CPU, device.type) and paths.dtype_ok(_CPU, dtype):
        p = arch.policy_for(device)
        if k < paths.min_width(_CPU, p):
            return "plain PyTorch"
        min_m = paths.token_range(_CPU, p)[0]
        if min_m <= 1:
            return "C++ CPU kernel"
        if static_m is None:
            return f"C++ CPU kernel from {min_m} tokens, else plain PyTorch"
        return "C++ CPU kernel" if static_m >= min_m else "plain PyTorch"
    return "plain PyTorch"


def decode_state_wanted(device: torch.device, dtype: torch.dtype, k: int, n: int, k_out: int,
                        gated: bool) -> bool:
    """Whether an inference FFN's decode path can ever win (M=1, density 0: its best case), so
    the backend should make its persistent decode state at compile time (the decode record
    uses one: ``Need.DECODE_STATE``)."""
    device = torch.device(device)
    if not (paths.runs_on(_DECODE, device.type) and paths.dtype_ok(_DECODE, dtype)):
        return False
    p = _static_policy(device)
    return decode_wins(p, 0.0, 1, k, n, k_out, gated)
