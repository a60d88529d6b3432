"""Per-layer sparsity statistics, kept on the device: no host sync until the user reads them.

Each rewritten FFN writes a small tensor after every call: summed and maximum non-zeros
per token, summed |h| and the number of rows or tiles that took the exact overflow path.
``layer_stats()`` reads them (this is the only host sync) into plain Python numbers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import Tensor

# On the device: [sum of non-zeros over tokens, max non-zeros of one token, sum of |h|,
# overflows]. Tokens and hidden width are shapes, known on the host at every call.
_FIELDS = 4
_lock = threading.Lock()
_buffers: dict[tuple[str, torch.device], Tensor] = {}
_hidden: dict[str, int] = {}
_tokens: dict[str, int] = {}


@dataclass(frozen=True)
class LayerStats:
    """Statistics of one FFN layer from its most recent call."""

    layer: str
    tokens: int
    hidden: int
    mean_nnz: float
    max_nnz: int
    l1: float
    overflows: int

    @property
    def density(self) -> float:
        return self.mean_nnz / self.hidden if self.hidden else 0.0


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


def device_buffer(layer: str, device: torch.device, tokens: int, hidden: int) -> Tensor:
    """The layer's float64 [4] buffer for a kernel that writes the fields itself (the decode
    kernel: no extra launches), with this call's host-side shape facts recorded."""
    buf = _buffers.get((layer, device))
    if buf is None:
        buf = reserve(layer, device)
    _hidden[layer] = hidden
    _tokens[layer] = tokens
    return buf


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
            buf = _buffers.setdefault(key, torch.zeros(_FIELDS, dtype=torch.float64, device=device))
    return buf


def layer_stats() -> dict[str, LayerStats]:
    """Latest statistics per layer name (as reported by ``explain``). Syncs with the device."""
    out: dict[str, LayerStats] = {}
    for (layer, _device), buf in sorted(_buffers.items(), key=lambda kv: kv[0][0]):
        if layer not in _hidden:  # reserved, never called yet
            continue
        nnz, mx, abs_sum, ovf = buf.tolist()
        tokens = _tokens[layer]
        hidden = _hidden[layer]
        out[layer] = LayerStats(
            layer=layer,
            tokens=int(tokens),
            hidden=hidden,
            mean_nnz=nnz / tokens if tokens else 0.0,
            max_nnz=int(mx),
            l1=abs_sum / (tokens * hidden) if tokens and hidden else 0.0,
            overflows=int(ovf),
        )
    return out


def reset_stats() -> None:
    """Forget every layer's statistics."""
    with _lock:
        _buffers.clear()
        _hidden.clear()
        _tokens.clear()
