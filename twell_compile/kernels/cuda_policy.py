"""Dense-or-TwELL choice for the CUDA inference op, made without a per-call host sync.

Two rules, in this order:

1. Shape rule (host, from shapes and dtypes only): TwELL only for bf16/fp16 with
   M >= MIN_TOKENS tokens, power-of-two tile_n in [32, 256], K and K_out <= 8192 (the fused
   kernel holds a whole x row and y row in registers). Everything else runs dense.
   fp32 stays dense: tl.dot would round its operands to tf32 (about 3e-4 relative error),
   over twice eager fp32's error.
2. Density rule (per layer, lagged): every call, dense or TwELL, writes the layer's non-zero
   count of relu(gate(x)) into a device tensor (TwELL: from the counts the gate kernel
   writes; dense: one count over h_g, only on probe calls). A non-blocking copy to pinned
   host memory and a CUDA event carry it back; a later call reads it only once
   ``event.query()`` says it has landed (never waits). The layer then runs TwELL while
   density <= MAX_DENSITY, dense otherwise. A layer starts dense (a probe call), so the
   first call never pays for a sparse path on a dense layer; dense layers re-probe every
   PROBE_EVERY calls, TwELL layers refresh every REFRESH_EVERY calls.

Under CUDA-graph capture nothing is polled or copied: the graph records the path chosen by
the calls before capture (torch.compile's reduce-overhead mode runs warm-up calls first).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

# Measured on H200 (docs/inference.md): TwELL beat dense at density 0.005 and lost at 0.02.
MAX_DENSITY = 0.01
MIN_TOKENS = 1024
MAX_WIDTH = 8192
PROBE_EVERY = 64
REFRESH_EVERY = 16
DTYPES = (torch.bfloat16, torch.float16)


def shape_ok(x: Tensor, m: int, k: int, k_out: int, tile_n: int, slots: int) -> bool:
    return (x.is_cuda and x.dtype in DTYPES and m >= MIN_TOKENS and k <= MAX_WIDTH
            and k_out <= MAX_WIDTH and tile_n in (32, 64, 128, 256) and 1 <= slots <= tile_n)


@dataclass
class _Layer:
    density: Optional[float] = None        # latest landed measurement
    calls: int = 0
    pending: Optional[tuple[torch.cuda.Event, Tensor, int]] = None  # (event, pinned, elements)
    host: Optional[Tensor] = field(default=None, repr=False)


_lock = threading.Lock()
_layers: dict[tuple, _Layer] = {}


def _state(key: tuple) -> _Layer:
    st = _layers.get(key)
    if st is None:
        with _lock:
            st = _layers.setdefault(key, _Layer())
    return st


def _poll(st: _Layer) -> None:
    if st.pending is not None:
        event, pinned, elements = st.pending
        if event.query():
            st.density = float(pinned[0]) / max(elements, 1)
            st.pending = None


def use_twell(key: tuple) -> bool:
    """True: run TwELL this call. Never syncs."""
    st = _state(key)
    if not torch.cuda.is_current_stream_capturing():
        _poll(st)
    return st.density is not None and st.density <= MAX_DENSITY


def wants_probe(key: tuple, twell: bool) -> bool:
    """Whether this call should measure the layer's density (cheap for TwELL, one pass dense)."""
    st = _state(key)
    if torch.cuda.is_current_stream_capturing() or st.pending is not None:
        return False
    every = REFRESH_EVERY if twell else PROBE_EVERY
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
    with _lock:
        _layers.clear()
