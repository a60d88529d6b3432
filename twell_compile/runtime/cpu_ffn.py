"""CPU inference FFN through the C++ kernel in ``csrc/cpu_ffn.cpp`` (fp32 and bf16).

The kernel runs the gate GEMM densely (ATen), counts the ReLU's non-zeros and then, inside the
same call, either does the up/down projections for active (token, neuron) pairs only or, when
the measured density exceeds the record's ``CpuPolicy.max_density(M)``, the dense up/down (see
docs/cpu.md). Whether the kernel runs at all is select.plan_infer's choice.

The extension is built on first use (never at import) and cached. If the build fails, a warning
with the reason is issued once and the exact plain-PyTorch implementation runs instead;
``active_impl()`` says which one is in use.

The kernel reads every weight in its own layout at every call and keeps no derived copy, so an
update made any way (in place through ``.data``, ``set_``, a fused optimizer, a rebinding)
is seen by the next call; a W_up whose columns are not unit-stride (a transposed view, rare) is
made contiguous per call. NaN/Inf follow the contract of every path (docs/cpu.md): gated rows
whose x holds NaN/Inf run eager's calls; an inactive neuron contributes 0 whatever its weights.
"""

from __future__ import annotations

import threading
import warnings
from typing import Optional

from torch import Tensor

from twell_compile import stats
from twell_compile.build import BuildError, load
from twell_compile.reference import ACTS
from twell_compile.runtime.arch import CpuPolicy


_lock = threading.Lock()
_module = None
_failure: Optional[str] = None


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
                # one line, once: a warning (the twell_compile logger keeps the build's log at DEBUG)
                warnings.warn(f"twell: CPU kernel unavailable, using plain PyTorch: {e}", RuntimeWarning,
                              stacklevel=3)
    return _module


def active_impl() -> str:
    """'cpu_ffn' when the C++ kernel is in use, else 'torch_impl: <reason>'. Builds if needed."""
    return "cpu_ffn" if extension() is not None else f"torch_impl: {_failure}"


def _unit_cols(w: Tensor) -> Tensor:
    """w with unit column stride: itself for nn.Linear weights and row slices of fused ones."""
    return w if w.stride(1) == 1 else w.contiguous()


def ffn_infer(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
              b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
              layer: str, keep_stats: bool, policy: CpuPolicy, act: str = "relu") -> Tensor:
    """The twell::ffn inference op on CPU through the C++ kernel (the plan chose it).
    ``policy``: the CPU record (its max_density for this call's token count, above which the
    kernel runs the dense up/down; block_tokens); ``act``: the activation (reference.ACTS)."""
    mod = extension()
    k, n, k_out = x.shape[-1], w_gate.shape[0], w_down.shape[0]
    x2 = x.reshape(-1, k).contiguous()
    up = None if w_up is None else _unit_cols(w_up)
    y, counts, abs_sum, _dense = mod.ffn_forward(x2, w_gate, b_gate, up, b_up, w_down, b_down,
                                                 policy.max_density(x2.shape[0]), keep_stats,
                                                 policy.block_tokens, ACTS.index(act))
    if keep_stats:
        stats.record(layer, counts, abs_sum, counts.new_zeros(()), n)
    return y.reshape(*x.shape[:-1], k_out)
