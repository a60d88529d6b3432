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
weak reference to the registered parameter: when the parameter is freed the entry goes with it
(its copy and state freed; before session 18 a dead entry held its 23 MB until a lookup of the
same key, so a process compiling model after model kept every old layer's copy), and if the
parameter now points elsewhere the entry is dropped at lookup (no stale data from a reused
address). If the parameter's version counter moved
(an in-place update: optimizer step, ``copy_``, ``load_state_dict``) the copy is refreshed in
place (``copy_``, same address) before use; the version check is host-only, no sync. Weights
never registered are transposed per call, uncached.

CUDA-graph replays run no host code: a graph captured before an in-place weight update keeps
reading the copy as it was. Call ``refresh()`` after updating weights in place between replays
(it rewrites every stale copy at its own address, so captured graphs see the new values).

Each entry also holds the decode path's persistent state (``decode_state``): an fp32
accumulator [STATE_ROWS, K_out], then one ticket per row block, non-zero counters per row and
an fp32 sum |h|, all zero between calls (the decode kernels' finish writes the zeros back),
so no launch zero-fills them: 0.5 MB at K_out=2048. One stream at a time per layer, as a model runs. (A first try of this in the v2
decode kernels, re-zeroed by a separate finishing launch, gave wrong sums on 1 of 3 CUDA-graph
replays on the H200, cause not found; tests/kernels/test_decode.py replays the v5 kernel many
times against eager.)
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class _Entry:
    base: weakref.ref          # the registered parameter (or the tensor w views)
    base_ptr: int
    view: tuple                # (storage offset, shape, stride) of w relative to base's storage
    wt: Optional[Tensor]       # w.t() contiguous (None: w.t() already is)
    version: int
    state: Optional[Tensor] = None   # decode accumulator + tickets, zero between calls


_lock = threading.RLock()    # re-entered when a garbage collection inside it drops an entry
_entries: dict[tuple, _Entry] = {}
STATE_ROWS = 64       # cuda_policy.DECODE_MAX_M: larger M gets a fresh zero-filled accumulator
STATE_TICKETS = 8     # row blocks of the state (>= STATE_ROWS / cuda_decode.MAX_MB)


def tail_size(rows: int) -> int:
    """int32 words of a decode state's tail for ``rows`` rows: tickets, a non-zero counter per
    row, the fp32 sum |h|, padding."""
    return STATE_TICKETS + rows + 8


def tail_parts(tail: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(tickets, counters per row, sum |h| as fp32 [1]) of a state's int32 tail (tail_size)."""
    tk, cnt, hs, _ = tail.split_with_sizes([STATE_TICKETS, tail.numel() - STATE_TICKETS - 8, 1, 7])
    return tk, cnt, hs.view(torch.float32)


STATE_TAIL = tail_size(STATE_ROWS)


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


def register(w: Tensor, base: Optional[Tensor] = None) -> bool:
    """Make (or keep) the W_down^T copy of ``w`` ([K_out, N]). ``base``: the long-lived
    tensor ``w`` views (default ``w`` itself), whose
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
        state = torch.zeros(STATE_ROWS * w.shape[0] + STATE_TAIL, dtype=torch.float32, device=w.device)
        entry = _Entry(weakref.ref(base, functools.partial(_drop, key)), base.data_ptr(), (w.storage_offset(), tuple(w.shape), tuple(w.stride())),
                       wt, base._version, state)
        with _lock:
            _entries[key] = entry
    return True


def _drop(key: tuple, ref: weakref.ref) -> None:
    """The registered parameter behind ``ref`` was freed: drop its entry (unless the key now
    holds a newer entry for another tensor at the same address)."""
    with _lock:
        e = _entries.get(key)
        if e is not None and e.base is ref:
            del _entries[key]


def _entry(w: Tensor) -> Optional[tuple[_Entry, Tensor]]:
    key = _key(w)
    e = _entries.get(key)
    base = None if e is None else _live(key, e)
    return None if base is None else (e, base)


def _transposed_of(w: Tensor, found: Optional[tuple[_Entry, Tensor]]) -> Tensor:
    wt = w.t()
    if found is None or found[0].wt is None:
        return wt if wt.is_contiguous() else wt.contiguous()
    e, base = found
    if base._version != e.version:
        with torch.no_grad():
            e.wt.copy_(wt)
        e.version = base._version
    return e.wt


def _state_of(w: Tensor, found: Optional[tuple[_Entry, Tensor]], rows: int) -> Optional[tuple[Tensor, Tensor]]:
    if found is None or found[0].state is None or rows > STATE_ROWS:
        return None
    st = found[0].state
    return st[:rows * w.shape[0]], st[STATE_ROWS * w.shape[0]:].view(torch.int32)


def transposed(w: Tensor) -> Tensor:
    """w.t() contiguous: the registered copy (refreshed if w changed in place) or a fresh one."""
    wt = w.t()
    return wt if wt.is_contiguous() else _transposed_of(w, _entry(w))


def decode_state(w: Tensor, rows: int) -> Optional[tuple[Tensor, Tensor]]:
    """The registered W_down's persistent decode state for ``rows`` <= STATE_ROWS rows: (fp32
    accumulator [rows * K_out], int32 tail [STATE_TAIL]: tickets, counters, sum |h|; see
    tail_parts), zero between calls; None if ``w`` is not registered or rows is
    larger (then the caller zero-fills its own)."""
    return _state_of(w, _entry(w), rows)


def decode_weights(w: Tensor, rows: int) -> tuple[Tensor, Optional[tuple[Tensor, Tensor]]]:
    """``(transposed(w), decode_state(w, rows))`` from one cache lookup (the decode path calls
    this once per call)."""
    found = _entry(w)
    return _transposed_of(w, found), _state_of(w, found, rows)


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


def state_bytes() -> int:
    """Memory held by the decode states."""
    return sum(e.state.numel() * 4 for e in _entries.values() if e.state is not None)


def cached_bytes() -> int:
    """Memory held by the copies."""
    return sum(e.wt.numel() * e.wt.element_size() for e in _entries.values() if e.wt is not None)


def clear() -> None:
    with _lock:
        _entries.clear()
