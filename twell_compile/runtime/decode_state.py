"""Per-weight decode state: the decode path's persistent accumulator, made once per W_down.

No weight values live here. The kernels read every weight from the parameter itself at every
call (W_down through its transposed view on the decode path, a per-call transpose on the
per-row path), so an update made any way (in place, through ``.data``, ``set_``, a fused
optimizer, a rebinding) is seen by the next call and by every CUDA-graph replay. (A cached
W_down^T copy would go stale: ``.data`` updates bump no version counter.)

Each entry holds the decode path's persistent state (``decode_state``): an fp32 accumulator
[STATE_ROWS, K_out], then one ticket per row block, non-zero counters per row and an fp32 sum
|h|, all zero between calls (the decode kernels' finish writes the zeros back), so no launch
zero-fills them: 0.5 MB at K_out=2048. One stream at a time per layer, as a model runs. The
backend registers W_down at compile time (backend.reserve_decode_state), outside any CUDA-graph
memory pool (a buffer first allocated during a cudagraph-tree warm-up would live in the
graph's private pool: "tensors in the cudagraph pool not tracked as outputs").

``decode_state(w, rows)`` finds the entry by (data_ptr, shape, stride, dtype, device). The entry
keeps a weak reference to the registered parameter: when the parameter is freed the entry goes
with it, and if the parameter now points elsewhere (``p.data = t``) the entry is dropped at
lookup. Weights never registered get a fresh zero-filled state per call.
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
    state: Tensor              # decode accumulator + tickets, zero between calls


_lock = threading.RLock()    # re-entered when a garbage collection inside it drops an entry
_entries: dict[tuple, _Entry] = {}
STATE_ROWS = 64       # the records' decode_max_m: larger M gets a fresh zero-filled accumulator
STATE_TICKETS = 8     # row blocks of the state (>= STATE_ROWS / arch.MAX_MB)


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


def register(w: Tensor, base: Optional[Tensor] = None) -> bool:
    """Make (or keep) the decode state of W_down ``w`` ([K_out, N]). ``base``: the long-lived
    tensor ``w`` views (default ``w`` itself), whose lifetime the entry follows. Returns True
    when an entry is held (False: an inference tensor, never registered)."""
    if not isinstance(w, Tensor) or w.dim() != 2:
        raise TypeError("w must be a 2-d torch.Tensor")
    base = w if base is None else base
    if base.is_inference():
        return False
    key = _key(w)
    e = _entries.get(key)
    if e is not None and _live(key, e) is base:
        return True
    with torch.inference_mode(False):        # kept across calls: never an inference tensor
        state = torch.zeros(STATE_ROWS * w.shape[0] + STATE_TAIL, dtype=torch.float32, device=w.device)
    entry = _Entry(weakref.ref(base, functools.partial(_drop, key)), base.data_ptr(), state)
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


def _state_of(w: Tensor, found: Optional[tuple[_Entry, Tensor]], rows: int) -> Optional[tuple[Tensor, Tensor]]:
    if found is None or rows > STATE_ROWS:
        return None
    st = found[0].state
    return st[:rows * w.shape[0]], st[STATE_ROWS * w.shape[0]:].view(torch.int32)


def decode_state(w: Tensor, rows: int) -> Optional[tuple[Tensor, Tensor]]:
    """The registered W_down's persistent decode state for ``rows`` <= STATE_ROWS rows: (fp32
    accumulator [rows * K_out], int32 tail [STATE_TAIL]: tickets, counters, sum |h|; see
    tail_parts), zero between calls; None if ``w`` is not registered or rows is
    larger (then the caller zero-fills its own)."""
    return _state_of(w, _entry(w), rows)


def state_bytes() -> int:
    """Memory held by the decode states."""
    return sum(e.state.numel() * 4 for e in _entries.values())


def clear() -> None:
    with _lock:
        _entries.clear()
