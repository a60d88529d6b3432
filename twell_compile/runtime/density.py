"""Per-layer density measurements, lagged and sync-free, kept per op instance.

A probe call writes the layer's non-zero count of relu(gate(x)) into a device tensor; a
non-blocking copy to pinned host memory and a CUDA event carry it back, and a later call reads
it only once ``event.query()`` says it has landed (never waits). Under CUDA-graph capture
nothing is polled or copied: the graph records the path chosen by the calls before capture, so
a graph compiled for CUDA graphs waits once for each layer's first measurement after the call
that made it (``settle``, called by the backend's wrapper), and its recording takes the
measured path.

State is per op instance: the passes and ``prepare`` give every op they insert an ``instance``
number unique in the process (``ops.next_instance``), and the runtime runs each call inside
its op's scope (``enter``), so a key (layer name, shapes) names a layer within one compiled op
only: a second model with the same layer names starts unmeasured. Direct calls of the op share
instance 0. ``reset`` (also run by ``torch._dynamo.reset()``) forgets everything.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import Tensor


@dataclass
class _Layer:
    density: Optional[float] = None        # latest landed measurement
    peak: Optional[float] = None           # the same probe's most non-zeros of one row (token),
                                           # None where the probe did not carry it
    calls: int = 0
    pending: Optional[tuple[torch.cuda.Event, Tensor, int, int]] = None  # (event, pinned, elements, fields)
    host: Optional[Tensor] = field(default=None, repr=False)
    path: str = ""                         # the path of the layer's last call (for reports)
    version: int = 0                       # bumped whenever a measurement lands (plans made from
                                           # an older one are stale)


_lock = threading.Lock()
_layers: dict[tuple, _Layer] = {}      # by (op instance, key)
_first: dict[int, _Layer] = {}         # states whose first measurement is in flight, by id (``settle``)
generation = 0                         # bumped by reset: every _Layer before it is forgotten


@functools.lru_cache(maxsize=None)
def _has_cuda() -> bool:
    return torch.cuda.is_available()


def capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph (False on CPU-only builds)."""
    return _has_cuda() and torch.cuda.is_current_stream_capturing()
_scope = threading.local()


def enter(instance: int) -> int:
    """Make ``instance`` the op instance whose state the following calls read and write;
    returns the previous one, to restore (a plain call: a context manager's generator costs a
    few us per op call, which decode-sized eager calls feel)."""
    prev = getattr(_scope, "instance", 0)
    _scope.instance = instance
    return prev


@contextlib.contextmanager
def scope(instance: int) -> Iterator[None]:
    """``enter`` as a context manager (tests and tools)."""
    prev = enter(instance)
    try:
        yield
    finally:
        enter(prev)


def instance() -> int:
    """The op instance of the call in progress (0 outside one, or for direct calls)."""
    return getattr(_scope, "instance", 0)


_in_graphs: set[int] = set()           # op instances compiled to run inside CUDA graphs


def mark_graphs(instance: int) -> None:
    """Op ``instance`` was compiled into a graph that runs inside CUDA graphs (reduce-overhead,
    twell.cudagraphs): its calls plan with the record's bounds for graphs, including the
    eager calls before the recording (their measurement is what the recording decides by).
    A fact of the compiled graph: ``reset`` keeps it."""
    _in_graphs.add(instance)


def in_graphs() -> bool:
    """Whether the call in progress runs inside a CUDA graph: the stream is capturing, or its
    op instance was compiled for CUDA graphs (``mark_graphs``)."""
    return capturing() or instance() in _in_graphs


def _state(key: tuple) -> _Layer:
    full = (instance(), key)
    st = _layers.get(full)
    if st is None:
        with _lock:
            st = _layers.setdefault(full, _Layer())
    return st


def state(key: tuple) -> _Layer:
    """The layer's state object in the current op instance (a plan cache holds it)."""
    return _state(key)


def take_landed(st: _Layer) -> None:
    """Take the state's pending measurement if it has landed (never waits); not under capture."""
    if st.pending is not None and not capturing():
        event, pinned, elements, fields = st.pending
        if event.query():
            st.density = float(pinned[0]) / max(elements, 1)
            st.peak = float(pinned[1]) if fields > 1 else None
            st.pending = None
            st.version += 1
            _first.pop(id(st), None)


def due(st: _Layer, every: int) -> bool:
    """``wants_probe`` on a state object."""
    return st.pending is None and not capturing() and (st.density is None or st.calls % every == 0)


def poll(key: tuple) -> Optional[float]:
    """The layer's latest landed density (None before the first lands), taking a landed
    measurement first. Never syncs; not under capture."""
    st = _state(key)
    take_landed(st)
    return st.density


def peak(key: tuple) -> Optional[float]:
    """The most non-zeros of one row in the layer's latest landed probe (None before one lands,
    or where that probe's path did not take it), without polling."""
    return _state(key).peak


def measured(key: tuple) -> Optional[float]:
    """Latest landed density of a layer, without polling (None before the first lands)."""
    return _state(key).density


def wants_probe(key: tuple, every: int) -> bool:
    """Whether this call should measure the layer: every ``every`` calls, and the first; one
    probe in flight at a time; never under capture."""
    return due(_state(key), every)


def tick(key: tuple, path: str = "") -> None:
    """Count a call of the layer (the probe interval's clock) and record its path."""
    st = _state(key)
    st.calls += 1
    if path:
        st.path = path


def record_path(key: tuple, path: str) -> None:
    _state(key).path = path


def last_path(key: tuple) -> str:
    """The path the layer's last call took ("" before any), for benchmarks and tests."""
    return _state(key).path


def submit(key: tuple, nnz: Tensor, elements: int) -> None:
    """Start the async readback of a non-zero count covering ``elements`` entries: a 0-d or
    1-element tensor, or 2 elements (the count, then the most non-zeros of one row: the
    statistics buffer's first two fields), whose second lands as the state's ``peak``."""
    fields = nnz.numel()
    if fields not in (1, 2):
        raise ValueError(f"submit takes a count, or a count and a row's peak: 1 or 2 elements, got {fields}")
    st = _state(key)
    if st.host is None:
        with torch.inference_mode(False):    # kept across calls: never an inference tensor
            st.host = torch.empty(2, dtype=torch.float64, device="cpu", pin_memory=True)
    st.host[:fields].copy_(nnz.reshape(fields).to(torch.float64), non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    st.pending = (event, st.host, elements, fields)
    if st.density is None:
        _first[id(st)] = st


def unsettled() -> bool:
    """Whether a layer's first measurement is in flight (``settle`` would wait for it)."""
    return bool(_first)


def settle() -> int:
    """Wait for every first measurement in flight and take it: a host sync, once per layer
    state (each key of each op instance), never under capture. For graphs recorded into CUDA
    graphs after a warm-up call (Inductor's reduce-overhead records the second call): without
    it the recording sees no measurement yet, takes the dense path, and replays it for good.
    Returns the measurements taken."""
    if capturing():
        return 0
    taken = 0
    for st in list(_first.values()):
        if st.pending is not None:
            st.pending[0].synchronize()
            take_landed(st)
            taken += 1
        _first.pop(id(st), None)
    return taken


def landed(key: tuple, value: float, peak: Optional[float] = None) -> None:
    """Store a measurement (and its row peak) as if its readback had landed (tools and tests
    without a GPU)."""
    st = _state(key)
    st.density = value
    st.peak = peak
    st.version += 1


def snapshot() -> list[tuple[int, tuple, Optional[float], str]]:
    """(op instance, key, latest density, last path) of every layer with state."""
    return [(inst, key, st.density, st.path) for (inst, key), st in list(_layers.items())]


def layers() -> int:
    """Layers with state, over every instance."""
    return len(_layers)


def reset() -> None:
    """Forget every layer's measurements, of every op instance."""
    global generation
    with _lock:
        _layers.clear()
        _first.clear()
        generation += 1
