"""W_down^T copies ([N, K_out], rows contiguous) made once per weight, for the sparse kernels'
row gathers (decode path and per-row path).

Transposing per call (23 MB each way at K=2048, N=5632: ~15 us on H200) would cost half of a
dense decode FFN (34 us). So the backend registers W_down at compile time (``register``) for
each rewritten CUDA inference FFN whose decode path can win (backend.reserve_weight_copies): the
copy is made there, outside any CUDA-graph memory pool (a copy first allocated during a
cudagraph-tree warm-up would live in the graph's private pool: "tensors in the cudagraph pool
not tracked as outputs"). Memory cost: one extra copy of W_down per registered layer (23 MB at
K=2048, N=5632 in bf16; 90 MB at K=4096, N=11008).

``transposed(w)`` finds the copy by (data_ptr, shape, stride, dtype, device). The entry keeps a
weak reference to the registered parameter: if that is gone or now points elsewhere the entry
is dropped (no stale data from a reused address). If the parameter's version counter moved
(an in-place update: optimizer step, ``copy_``, ``load_state_dict``) the copy is refreshed in
place (``copy_``, same address) before use; the version check is host-only, no sync. Weights
never registered are transposed per call, uncached.

CUDA-graph replays run no host code: a graph captured before an in-place weight update keeps
reading the copy as it was. Call ``refresh()`` after updating weights in place between replays
(it rewrites every stale copy at its own address, so captured graphs see the new values).

Each entry also holds the decode path's fp32 accumulator ([ACC_ROWS, K_out], 0.5 MB at
K_out=2048), kept zero between calls: the decode kernels add into it and the finishing kernel
writes the zeros back, which saves a zero-fill launch per call (~1.5 us of a ~15 us decode FFN).
One stream at a time per layer (as a model runs); a call cut short between the two launches
marks it dirty and the next call zero-fills it first (host flag, no sync).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


ACC_ROWS = 64                  # cuda_policy.DECODE_MAX_M: larger M zero-fills per call


@dataclass
class _Entry:
    base: weakref.ref          # the registered parameter (or the tensor w views)
    base_ptr: int
    view: tuple                # (storage offset, shape, stride) of w relative to base's storage
    wt: Optional[Tensor]       # w.t() contiguous (None: w.t() already is)
    version: int
    acc: Optional[Tensor] = None   # [ACC_ROWS, K_out] fp32, zero between decode calls
    dirty: bool = False


_lock = threading.Lock()
_entries: dict[tuple, _Entry] = {}


def _key(w: Tensor) -> tuple:
    return (w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, w.device)


def _live(key: tuple, e: _Entry) -> Optional[Tensor]:
    """The entry's parameter if the entry still describes it, else None (entry dropped)."""
    base = e.base()
    if base is None or base.data_ptr() != e.base_ptr:
        with _lock:
            if _entries.get(key) is e:
                del _entries[key]
        return None
    return base


def _view_of(base: Tensor, e: _Entry) -> Tensor:
    off, shape, stride = e.view
    return base.as_strided(shape, stride, off)


def wanted(w: Tensor) -> bool:
    """Whether the backend should make a copy: a 2-d CUDA bf16/fp16 weight (the sparse paths)."""
    from twell_compile.kernels.cuda_policy import DTYPES

    return w.dim() == 2 and w.is_cuda and w.dtype in DTYPES


def register(w: Tensor, base: Optional[Tensor] = None, with_acc: bool = True) -> bool:
    """Make (or keep) the W_down^T copy of ``w`` ([K_out, N]) and the decode accumulator. ``base``: the long-lived tensor ``w`` views (default ``w`` itself), whose
    lifetime and version counter the entry follows. Returns True when an entry is held (False:
    an inference tensor, which keeps no version counter)."""
    if not isinstance(w, Tensor) or w.dim() != 2:
        raise TypeError("w must be a 2-d torch.Tensor")
    base = w if base is None else base
    if base.is_inference():
        return False
    key = _key(w)
    with torch.no_grad():
        e = _entries.get(key)
        if e is not None and _live(key, e) is base:
            return True
        wt = None if w.t().is_contiguous() else w.t().contiguous()
        acc = (torch.zeros((ACC_ROWS, w.shape[0]), dtype=torch.float32, device=w.device)
               if with_acc else None)
        entry = _Entry(weakref.ref(base), base.data_ptr(), (w.storage_offset(), tuple(w.shape), tuple(w.stride())),
                       wt, base._version, acc)
        with _lock:
            _entries[key] = entry
    return True


def _entry(w: Tensor) -> Optional[tuple[_Entry, Tensor]]:
    key = _key(w)
    e = _entries.get(key)
    base = None if e is None else _live(key, e)
    return None if base is None else (e, base)


def transposed(w: Tensor) -> Tensor:
    """w.t() contiguous: the registered copy (refreshed if w changed in place) or a fresh one."""
    wt = w.t()
    if wt.is_contiguous():
        return wt
    found = _entry(w)
    if found is None or found[0].wt is None:
        return wt.contiguous()
    e, base = found
    if base._version != e.version:
        with torch.no_grad():
            e.wt.copy_(wt)
        e.version = base._version
    return e.wt


class Accumulator:
    """The decode path's zeroed fp32 accumulator of a registered W_down, as a context: entering
    gives acc[:m] (zero-filled first if a previous call was cut short), leaving normally marks
    it clean (the finishing kernel has written the zeros back)."""

    def __init__(self, e: _Entry, m: int):
        self.e, self.m = e, m

    def __enter__(self) -> Tensor:
        if self.e.dirty:
            self.e.acc.zero_()
        self.e.dirty = True
        return self.e.acc[: self.m]

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.e.dirty = False


def accumulator(w: Tensor, m: int) -> Optional[Accumulator]:
    """The persistent accumulator for W_down ``w`` and m rows, or None (not registered, or
    m > ACC_ROWS): then the caller zero-fills its own."""
    found = _entry(w)
    if found is None or found[0].acc is None or m > found[0].acc.shape[0]:
        return None
    return Accumulator(found[0], m)


def refresh() -> int:
    """Rewrite every copy whose parameter changed in place since (for CUDA-graph replays).
    Returns the number of copies rewritten."""
    done = 0
    for key, e in list(_entries.items()):
        base = _live(key, e)
        if base is not None and e.wt is not None and base._version != e.version:
            with torch.no_grad():
                e.wt.copy_(_view_of(base, e).t())
            e.version = base._version
            done += 1
    return done


def cached_bytes() -> int:
    """Memory held by the copies and accumulators."""
    return sum(t.numel() * t.element_size() for e in _entries.values() for t in (e.wt, e.acc) if t is not None)


def clear() -> None:
    with _lock:
        _entries.clear()
