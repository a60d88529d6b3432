"""Per-layer sparsity statistics, kept on the device: no host sync until the user reads them.

Each rewritten FFN writes a small tensor after every call: summed and maximum non-zeros
per token, summed |h| and the number of rows or tiles that took the exact overflow path.
Training calls also stamp, per hidden unit, the layer's training-token count at the end of the
latest call in which the unit fired ([N] fp64, one masked fill): a unit whose stamp is older
than the last ``DEAD_WINDOW`` tokens is dead. ``layer_stats()`` reads them (this is the only
host sync), with the coefficient ``twell.target_density``'s controller holds (control.py),
into plain Python numbers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from twell_compile import control
from twell_compile.report import table

# On the device: [sum of non-zeros over tokens, max non-zeros of one token, sum of |h|,
# overflows]. Tokens and hidden width are shapes, known on the host at every call.
_FIELDS = 4
_lock = threading.Lock()
_buffers: dict[tuple[str, torch.device], Tensor] = {}
_hidden: dict[str, int] = {}
_tokens: dict[str, int] = {}
DEAD_WINDOW = 32768     # training tokens: a unit that fired on none of a layer's last ones is dead
_fired: dict[tuple[str, torch.device], Tensor] = {}
_seen: dict[str, int] = {}             # training tokens a layer has run


@dataclass(frozen=True)
class LayerStats:
    """Statistics of one rewritten FFN layer from its most recent call.

    layer: module path, the name ``explain`` reports (e.g. "model.layers.0.mlp").
    tokens: rows of x in that call (the product of all dims but the last), count.
    hidden: N, the FFN's hidden units (ReLU outputs per token), count.
    mean_nnz: non-zero ReLU outputs (active hidden units) per token, averaged over the call's
        tokens; count in [0, hidden].
    max_nnz: the largest number of non-zeros of one token in that call, count.
    l1: mean |h| over tokens and hidden units, in the units of the hidden activation h (the
        per-layer mean that ``twell.l1`` multiplies; the coefficient is not applied).
    overflows: rows or tiles that took the exact slower path in that call, count (training:
        rows beyond the ELL part and the dense backup, recomputed in the backward; CUDA
        inference: tokens over the compact width); 0 on paths without one.
    dead: hidden units that fired on none of the layer's last ``dead_window`` training tokens,
        count; None for a layer that has not trained (inference calls do not count). Rows the
        CUDA training path recomputes in the backward (``overflows``) are not looked at.
    dead_window: the training tokens ``dead`` looks back over: min(tokens trained,
        ``DEAD_WINDOW`` = 32768, whole calls), count; 0 when not trained.
    l1_coef: the layer's L1 coefficient under ``twell.target_density`` (twell.l1's units: the
        fixed ``twell.l1`` that would push this layer as hard), None when not controlled.
    target: the density ``twell.target_density`` asks of the layer, None when not controlled.
    density (property): mean_nnz / hidden, a fraction in [0, 1].
    """

    layer: str
    tokens: int
    hidden: int
    mean_nnz: float
    max_nnz: int
    l1: float
    overflows: int
    dead: Optional[int] = None
    dead_window: int = 0
    l1_coef: Optional[float] = None
    target: Optional[float] = None

    @property
    def density(self) -> float:
        return self.mean_nnz / self.hidden if self.hidden else 0.0


class StatsTable(dict):
    """``layer_stats()``'s result: a plain ``dict`` {layer: LayerStats} that prints as a table."""

    def __str__(self) -> str:
        if not self:
            return "twell layer_stats: no rewritten FFN has run yet (stats are kept per layer from its latest call)"
        rows = [("layer", "tokens", "hidden", "mean nnz", "density", "max nnz", "mean |h|", "overflows", "dead")]
        rows += [(name, str(s.tokens), str(s.hidden), f"{s.mean_nnz:.1f}", f"{100 * s.density:.2f}%",
                  str(s.max_nnz), f"{s.l1:.4g}", str(s.overflows), "-" if s.dead is None else str(s.dead))
                 for name, s in self.items()]
        if any(s.l1_coef is not None for s in self.values()):
            rows[0] += ("target", "l1 coef")
            rows[1:] = [r + (("-", "-") if s.l1_coef is None else (f"{100 * s.target:.2f}%", f"{s.l1_coef:.4g}"))
                        for r, s in zip(rows[1:], self.values())]
        return "\n".join([f"twell layer_stats: {len(self)} layer(s), each from its latest call"] + table(rows))

    __repr__ = __str__


def record(layer: str, counts: Tensor, abs_sum: Tensor, overflows: Tensor, hidden: int) -> None:
    """Store a layer's statistics in a persistent buffer (async; CUDA-graph safe).

    counts: non-zeros per token [M] (any integer dtype); abs_sum: sum of |h| (0-d);
    overflows: rows or tiles that took the exact overflow path (0-d).
    """
    buf = _buffers.get((layer, counts.device))
    if buf is None:
        buf = reserve(layer, counts.device)
    _hidden[layer] = hidden
    _tokens[layer] = counts.numel()
    f64 = torch.float64
    mx = counts.max().to(f64) if counts.numel() else buf.new_zeros(())
    # Written straight into the buffer: 6 small launches, no [M]-sized temporary.
    torch.stack([counts.sum(dtype=f64), mx, abs_sum.to(f64), overflows.to(f64)], out=buf)


def record_fired(layer: str, fired: Tensor, tokens: int) -> None:
    """A training call of ``layer`` over ``tokens`` tokens: ``fired`` [N] bool marks the hidden
    units that were non-zero on at least one of them (async; one masked fill)."""
    key = (layer, fired.device)
    with torch.inference_mode(False):
        buf = _fired.get(key)
        if buf is None or buf.shape != fired.shape:
            with _lock:
                buf = _fired[key] = torch.zeros(fired.shape, dtype=torch.float64, device=fired.device)
                _seen[layer] = 0
        seen = _seen.get(layer, 0) + tokens
        _seen[layer] = seen
        buf.masked_fill_(fired, float(seen))


def device_buffer(layer: str, device: torch.device, tokens: int, hidden: int) -> Tensor:
    """The layer's float64 [4] buffer for a kernel that writes the fields itself (the decode
    kernel: no extra launches), with this call's host-side shape facts recorded."""
    buf = _buffers.get((layer, device))
    if buf is None:
        buf = reserve(layer, device)
    _hidden[layer] = hidden
    _tokens[layer] = tokens
    return buf


def _new_buffer(device: torch.device) -> Tensor:
    # Never an inference tensor: a buffer first made under torch.inference_mode() would refuse
    # every later in-place write outside it (the next training call, another model's layer).
    with torch.inference_mode(False):
        return torch.zeros(_FIELDS, dtype=torch.float64, device=device)


def scratch_buffer(device: torch.device) -> Tensor:
    """A buffer shaped like a layer's, belonging to none (kernel warm-ups write it)."""
    return _new_buffer(device)


def reserve(layer: str, device: torch.device) -> Tensor:
    """Allocate a layer's buffer now. The backend calls this at compile time: a buffer first
    allocated inside a CUDA-graph warm-up would live in the graph's private memory pool."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (layer, device)
    buf = _buffers.get(key)
    if buf is None:
        with _lock:
            buf = _buffers.setdefault(key, _new_buffer(device))
    return buf


def densities() -> dict[str, Tensor]:
    """Each layer's density in its latest call as a 0-d fp64 tensor on its device (one division
    per layer, no host sync): for keeping a per-step history, read once at the end."""
    out = {}
    for (layer, _device), buf in sorted(_buffers.items(), key=lambda kv: kv[0][0]):
        if layer in _hidden:
            out[layer] = buf[0] / max(_tokens[layer] * _hidden[layer], 1)
    return out


def layer_stats() -> StatsTable:
    """Latest statistics per layer: ``{layer name: LayerStats}`` (fields and units in
    ``LayerStats``), a dict that prints as a table. Layer names are those ``explain`` reports;
    a layer's entry is from its most recent call (forward of a training step included). Syncs
    with the device once (the only host sync of the statistics)."""
    out = StatsTable()
    for (layer, _device), buf in sorted(_buffers.items(), key=lambda kv: kv[0][0]):
        if layer not in _hidden:  # reserved, never called yet
            continue
        nnz, mx, abs_sum, ovf = buf.tolist()
        tokens = _tokens[layer]
        hidden = _hidden[layer]
        fired, seen = _fired.get((layer, _device)), _seen.get(layer, 0)
        dead = None
        if fired is not None:
            dead = int((fired <= float(max(0, seen - DEAD_WINDOW))).sum())
        coef = control.coefficient(layer)
        out[layer] = LayerStats(
            layer=layer,
            tokens=int(tokens),
            hidden=hidden,
            mean_nnz=nnz / tokens if tokens else 0.0,
            max_nnz=int(mx),
            l1=abs_sum / (tokens * hidden) if tokens and hidden else 0.0,
            overflows=int(ovf),
            dead=dead,
            dead_window=min(seen, DEAD_WINDOW) if fired is not None else 0,
            l1_coef=None if coef is None else float(coef.item()),
            target=control.target_of(layer) if coef is not None else None,
        )
    return out


def snapshot() -> tuple:
    """Copies of every buffer and shape fact, for ``restore`` (explain: a failed call leaves the
    statistics as they were)."""
    with _lock:
        with torch.inference_mode(False):
            return ({k: b.clone() for k, b in _buffers.items()}, dict(_hidden), dict(_tokens),
                    {k: b.clone() for k, b in _fired.items()}, dict(_seen))


def restore(saved: tuple) -> None:
    """Undo every record since ``snapshot``: buffers made since are dropped, older ones are
    written back in place (compiled graphs keep pointing at the same buffer)."""
    buffers, hidden, tokens, fired, seen = saved
    with _lock:
        _fired.clear()
        _fired.update(fired)
        _seen.clear()
        _seen.update(seen)
        for key in [k for k in _buffers if k not in buffers]:
            del _buffers[key]
        for key, old in buffers.items():
            if key in _buffers:
                _buffers[key].copy_(old)
        _hidden.clear()
        _hidden.update(hidden)
        _tokens.clear()
        _tokens.update(tokens)


def reset_stats() -> None:
    """Forget every layer's statistics."""
    with _lock:
        _buffers.clear()
        _hidden.clear()
        _tokens.clear()
        _fired.clear()
        _seen.clear()
