"""CPU inference FFN through the C++ kernel in ``csrc/cpu_ffn.cpp`` (fp32 and bf16).

The kernel runs the gate GEMM densely (ATen), counts the ReLU's non-zeros and then, inside the
same call, either does the up/down projections for active (token, neuron) pairs only or, when
the measured density exceeds ``max_density(M)``, the dense up/down (see docs/cpu.md).

The extension is built on first use (never at import) and cached. If the build fails, a warning
with the reason is issued once and the exact plain-PyTorch implementation runs instead;
``active_impl()`` says which one is in use.

Weight layouts the kernel reads (cached per weight, keyed on storage pointer, shape, strides and
version counter so in-place updates invalidate them):
  W_down^T [N, K_out] with unit column stride: free when w_down is itself a transposed view,
      otherwise one transposed copy per layer (the size of W_down: 46 MB fp32 at 2048 x 5632).
  W_up with unit column stride: free for nn.Linear weights and row slices of fused weights.
  max|W_up|, max|b_up|, max|W_down|: scalars bounding the up projection (rows that could overflow
      go dense) and detecting non-finite weights (then dense, as exact as eager).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import warnings
from collections import OrderedDict
from typing import Callable, Optional

import torch
from torch import Tensor

from twell_compile import stats
from twell_compile.build import BuildError, load

log = logging.getLogger(__name__)

DTYPES = (torch.float32, torch.bfloat16)
# Derived copies kept at most (LRU, bytes); ~ 40 layers of 2048 x 5632 fp32 W_down^T.
CACHE_BYTES = int(os.environ.get("TWELL_CPU_CACHE_MB", "2048")) * 2**20

_lock = threading.Lock()
_module = None
_failure: Optional[str] = None
_cache: "OrderedDict[tuple, tuple[Tensor, object, int]]" = OrderedDict()
_cache_bytes = 0


def extension():
    """The built extension, or None (after one warning) when it cannot be built."""
    global _module, _failure
    if _module is not None or _failure is not None:
        return _module
    with _lock:
        if _module is None and _failure is None:
            try:
                _module = load("cpu_ffn", openmp=True)
            except BuildError as e:
                _failure = str(e)
                log.warning("twell: CPU kernel unavailable, using plain PyTorch: %s", e)
                warnings.warn(f"twell: CPU kernel unavailable, using plain PyTorch: {e}", RuntimeWarning,
                              stacklevel=3)
    return _module


def active_impl() -> str:
    """'cpu_ffn' when the C++ kernel is in use, else 'torch_impl: <reason>'. Builds if needed."""
    return "cpu_ffn" if extension() is not None else f"torch_impl: {_failure}"


# Below this many multiply-adds (M N (K + K_out)) the whole dense FFN takes < ~30 us and the
# kernel's fixed cost (~15 us: weight-cache look-ups, CSR set-up) cannot pay off; measured
# 36 vs 20 us at M N (K + K_out) = 6400, 290 vs 430 us at 1.5e6 (docs/cpu.md).
MIN_WORK = 1 << 17


def supports(x: Tensor, w_gate: Tensor, w_down: Tensor) -> bool:
    """Shape/dtype-only test: the kernel handles this call and can win (builds on demand)."""
    if x.device.type != "cpu" or x.dtype not in DTYPES:
        return False
    m = math.prod(x.shape[:-1])
    if m * w_gate.shape[0] * (w_gate.shape[1] + w_down.shape[0]) < MIN_WORK:
        return False
    return extension() is not None


def max_density(m: int) -> float:
    """Density above which the dense up/down is faster, by tokens per call (docs/cpu.md).

    Sparse costs ~one weight-row read per active (token block, neuron) plus a K-long dot and
    axpy per active pair at cache bandwidth; dense costs the two GEMMs, memory-bound at small M
    (the weights stream once) and compute-bound at large M. Break-evens measured at K = 2048,
    N = 5632 on the 2-core Xeon (AVX-512): M = 1 sparse wins up to d ~ 0.5; M = 16 sparse was
    1.6-1.7x at d = 0.05 but 1.15x (1 thread) / 0.94x (2 threads) of Inductor at d = 0.2 on a
    quiet machine, so M <= 64 goes dense above 0.12; M >= 256 to ~ 0.1 (sparse 1.5x faster at
    0.05, dense 1.5-2x faster at 0.2).
    """
    if m <= 4:
        return 0.5
    if m <= 64:
        return 0.12
    return 0.1


def block_tokens(k: int, k_out: int, element_size: int) -> int:
    """Tokens per block of the sparse part: their x and y rows fill ~2 MB (the L2 of one core)."""
    row_bytes = k * element_size + k_out * 4  # x row in its dtype, y row accumulated in fp32
    return max(16, min(512, (2 << 20) // row_bytes))


def _key(t: Tensor, tag: str) -> Optional[tuple]:
    if t.is_inference():  # no version counter: cannot see in-place updates, so never cache
        return None
    return (tag, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)


def _cached(t: Tensor, tag: str, make: Callable[[Tensor], object], nbytes: int) -> object:
    """make(t), cached while t's storage and version are unchanged (holds t to pin its address)."""
    global _cache_bytes
    key = _key(t, tag)
    if key is None:
        return make(t)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit[1]
    value = make(t)
    with _lock:
        _cache[key] = (t, value, nbytes)
        _cache_bytes += nbytes
        while _cache_bytes > CACHE_BYTES and len(_cache) > 1:
            _, (_, _, size) = _cache.popitem(last=False)
            _cache_bytes -= size
    return value


def clear_cache() -> None:
    """Drop every cached weight copy (e.g. after deleting a model)."""
    global _cache_bytes
    with _lock:
        _cache.clear()
        _cache_bytes = 0


def _down_t(w_down: Tensor) -> Tensor:
    if w_down.stride(0) == 1:  # already a transposed view: W_down^T rows are contiguous
        return w_down.t()
    return _cached(w_down, "down_t", lambda w: w.t().contiguous(), w_down.numel() * w_down.element_size())


def _unit_cols(w: Tensor) -> Tensor:
    if w.stride(1) == 1:
        return w
    return _cached(w, "rows", lambda t: t.contiguous(), w.numel() * w.element_size())


def _abs_max(t: Optional[Tensor]) -> float:
    if t is None or t.numel() == 0:
        return 0.0
    return float(_cached(t, "absmax", lambda v: v.detach().abs().max().float().item(), 0))


def ffn_infer(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
              b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
              layer: str, keep_stats: bool) -> Tensor:
    """The twell::ffn inference op on CPU through the C++ kernel (``supports`` said yes)."""
    mod = extension()
    k, n, k_out = x.shape[-1], w_gate.shape[0], w_down.shape[0]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    up = None if w_up is None else _unit_cols(w_up)
    # Non-finite weights make dense PyTorch put NaN where a sparse kernel skips work (0 * Inf):
    # max|W_up| = Inf/NaN sends every row dense in the kernel; a non-finite W_down, the whole call.
    thr = max_density(m)
    if not math.isfinite(_abs_max(w_down)):
        thr = -1.0
    y, counts, abs_sum, _dense = mod.ffn_forward(x2, w_gate, b_gate, up, b_up, w_down, _down_t(w_down),
                                                 b_down, thr, _abs_max(w_up), _abs_max(b_up), keep_stats,
                                                 block_tokens(k, k_out, x.element_size()))
    if keep_stats:
        stats.record(layer, counts, abs_sum, counts.new_zeros(()), n)
    return y.reshape(*x.shape[:-1], k_out)
