"""Sparse activation formats: TwELL (inference) and hybrid ELL + dense backup (training).

Plain-PyTorch pack/unpack, exact bit for bit on any input. GPU kernels produce and consume the
same layouts, so the layouts below are a contract.

A value counts as non-zero when its *bits* are non-zero: -0.0, NaN and Inf are kept, so
``unpack(pack(h))`` reproduces ``h`` bit for bit (ReLU outputs are never -0.0, but NaN must
survive: dense PyTorch propagates it).

TwELL, for h of shape [M, N], tile width ``tile_n``, ``slots`` slots per tile
(``n_tiles = ceil(N / tile_n)``; the last tile is zero-padded):

    values    [M, n_tiles, slots]  h.dtype  the first ``slots`` non-zeros of the tile, in
                                            column order; unused slots hold +0.0
    cols      [M, n_tiles, slots]  int16    their column inside the tile (0 .. tile_n-1);
                                            unused slots hold 0
    counts    [M, n_tiles]         int32    non-zeros in the tile; may exceed ``slots``
    ovf_tiles [R]                  int64    row * n_tiles + tile for each tile with
                                            counts > slots, ascending
    ovf_values[R, tile_n]          h.dtype  those tiles, dense (exact path)

Hybrid, for h [M, N] and ELL width ``width``:

    values     [M, width]  h.dtype  the first ``width`` non-zeros of each row (column order);
                                    unused slots hold +0.0
    cols       [M, width]  int32    their columns (0 .. N-1); unused slots hold 0
    counts     [M]         int32    non-zeros in the row; may exceed ``width``
    backup_rows[C]         int64    rows with counts > width, ascending, then -1 padding;
                                    C is the backup capacity (all such rows by default).
                                    The CUDA training kernels hand out slots with an atomic
                                    counter: any order there, and rows whose x is non-finite
                                    count as busy too
    backup     [C, N]      h.dtype  those rows, dense; padding rows are zero

The training op saves this format twice over the same cols/counts/backup_rows: for h_g and
for the up projection u (u is read only where h_g is non-zero, or on rows with non-finite x;
the CUDA kernels store zeros elsewhere in the backup, torch_impl the whole row). The CUDA
dense path saves a degenerate form instead: C = M, backup_rows = 0..M-1, the backups holding
the gate pre-activation g and u of every row, values/cols unwritten; a backup of M rows marks
it (the sparse path runs only with C < M).

Rows with counts > width that do not fit the backup are *missing*: ``unpack_hybrid`` refuses
them unless a ``recompute`` callback supplies them (the training op recomputes them exactly
from x in its backward). Nothing is ever silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

_INT_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def nonzero_mask(h: Tensor) -> Tensor:
    """True where the bits of ``h`` are not all zero (keeps -0.0, NaN, Inf)."""
    if not h.is_floating_point():
        raise TypeError(f"h must be a floating-point tensor, got {h.dtype}")
    return h.contiguous().view(_INT_OF[h.element_size()]) != 0


def _check_2d(h: Tensor) -> None:
    if not isinstance(h, Tensor):
        raise TypeError(f"h must be a torch.Tensor, got {type(h).__name__}")
    if h.dim() != 2:
        raise ValueError(f"h must be 2-D [M, N], got shape {tuple(h.shape)}")


def _bits(t: Tensor) -> Tensor:
    """The same memory as integers: copies through it keep NaN payloads and -0.0 exactly."""
    return t.contiguous().view(_INT_OF[t.element_size()])


def _compact(values: Tensor, nz: Tensor, capacity: int) -> tuple[Tensor, Tensor, Tensor]:
    """Move the first ``capacity`` non-zeros of each last-dim row to the front.

    Returns (packed values [..., capacity], their positions [..., capacity] as int64, counts).
    """
    dtype = values.dtype
    values = _bits(values)
    counts = nz.sum(-1, dtype=torch.int32)
    rank = nz.cumsum(-1) - 1
    keep = nz & (rank < capacity)
    # Non-kept entries go to a dump slot at index ``capacity``, dropped afterwards.
    slot = torch.where(keep, rank, torch.full_like(rank, capacity))
    shape = (*values.shape[:-1], capacity + 1)
    out_v = values.new_zeros(shape).scatter_(-1, slot, torch.where(keep, values, 0))
    pos = torch.arange(values.shape[-1], device=values.device).expand_as(rank)
    out_c = torch.zeros(shape, dtype=torch.int64, device=values.device).scatter_(-1, slot, torch.where(keep, pos, 0))
    return out_v[..., :capacity].contiguous().view(dtype), out_c[..., :capacity].contiguous(), counts


@dataclass(frozen=True)
class TwELL:
    values: Tensor
    cols: Tensor
    counts: Tensor
    ovf_tiles: Tensor
    ovf_values: Tensor
    n_cols: int
    tile_n: int

    @property
    def slots(self) -> int:
        return self.values.shape[-1]

    @property
    def n_tiles(self) -> int:
        return self.values.shape[1]


def pack_twell(h: Tensor, tile_n: int = 128, slots: int = 16) -> TwELL:
    _check_2d(h)
    if not isinstance(tile_n, int) or tile_n < 1:
        raise ValueError(f"tile_n must be a positive int, got {tile_n!r}")
    if not isinstance(slots, int) or not 1 <= slots <= tile_n:
        raise ValueError(f"slots must be an int in [1, tile_n={tile_n}], got {slots!r}")
    m, n = h.shape
    n_tiles = max(1, -(-n // tile_n))
    padded = torch.nn.functional.pad(h, (0, n_tiles * tile_n - n)) if n_tiles * tile_n != n else h
    tiles = padded.reshape(m, n_tiles, tile_n)
    nz = nonzero_mask(tiles)
    values, cols, counts = _compact(tiles, nz, slots)
    over = (counts > slots).reshape(-1)
    ovf_tiles = over.nonzero().reshape(-1)
    ovf_values = tiles.reshape(-1, tile_n)[ovf_tiles]
    return TwELL(values, cols.to(torch.int16), counts, ovf_tiles, ovf_values, n, tile_n)


def unpack_twell(p: TwELL) -> Tensor:
    m, n_tiles, slots = p.values.shape
    live = torch.arange(slots, device=p.values.device) < p.counts.unsqueeze(-1)
    idx = torch.where(live, p.cols.long(), p.tile_n)  # dead slots go to the dump column
    vals = _bits(p.values)
    dense = vals.new_zeros(m, n_tiles, p.tile_n + 1)
    dense.scatter_(-1, idx, vals)
    dense = dense[..., : p.tile_n].reshape(m * n_tiles, p.tile_n)
    dense[p.ovf_tiles] = _bits(p.ovf_values)
    return dense.reshape(m, n_tiles * p.tile_n)[:, : p.n_cols].contiguous().view(p.values.dtype)


@dataclass(frozen=True)
class Hybrid:
    values: Tensor
    cols: Tensor
    counts: Tensor
    backup_rows: Tensor
    backup: Tensor

    @property
    def width(self) -> int:
        return self.values.shape[-1]

    def missing_rows(self) -> Tensor:
        """Rows too busy for the ELL part that the backup could not hold."""
        busy = self.counts > self.width
        stored = torch.zeros_like(busy)
        valid = self.backup_rows[self.backup_rows >= 0]
        stored[valid] = True
        return (busy & ~stored).nonzero().reshape(-1)


def backup_capacity(m: int, backup_rows: int) -> int:
    """Dense backup rows for M tokens: ceil(M / backup_rows), at least 2. Works on SymInts too.

    The floor of 2 keeps the size away from 1: with a symbolic M, a capacity that can be 1
    makes AOTAutograd/Inductor guard on ``capacity == 1`` and recompile when the batch grows.
    """
    return torch.sym_max((m + backup_rows - 1) // backup_rows, 2)


def ell_width_for(ell_width: int, n: int) -> int:
    """The ELL part's width for N hidden units: ``ell_width`` (twell.ell_width), at most N. Every
    training path's state and its fakes take this width."""
    return min(ell_width, n)


def pack_hybrid(h: Tensor, width: int = 64, capacity: Optional[int] = None) -> Hybrid:
    """Pack h [M, N]; ``capacity`` bounds the dense backup (None: every busy row fits)."""
    _check_2d(h)
    if not isinstance(width, int) or width < 0:
        raise ValueError(f"width must be an int >= 0, got {width!r}")
    if capacity is not None and (not isinstance(capacity, int) or capacity < 0):
        raise ValueError(f"capacity must be None or an int >= 0, got {capacity!r}")
    values, cols, counts = _compact(h, nonzero_mask(h), width)
    busy = (counts > width).nonzero().reshape(-1)
    cap = busy.numel() if capacity is None else capacity
    rows = torch.full((cap,), -1, dtype=torch.int64, device=h.device)
    take = busy[:cap]
    rows[: take.numel()] = take
    backup = _bits(h).new_zeros(cap, h.shape[1])
    backup[: take.numel()] = _bits(h)[take]
    backup = backup.view(h.dtype)
    return Hybrid(values, cols.to(torch.int32), counts, rows, backup)


def unpack_hybrid(p: Hybrid, n_cols: int, recompute: Optional[Callable[[Tensor], Tensor]] = None) -> Tensor:
    """Dense h [M, n_cols]. ``recompute(rows) -> h[rows]`` supplies missing rows, if any."""
    m, width = p.values.shape
    live = torch.arange(width, device=p.values.device) < p.counts.unsqueeze(-1)
    idx = torch.where(live, p.cols.long(), n_cols)
    vals = _bits(p.values)
    dense = vals.new_zeros(m, n_cols + 1).scatter_(-1, idx, vals)[:, :n_cols]
    valid = p.backup_rows >= 0
    dense[p.backup_rows[valid]] = _bits(p.backup)[valid]
    missing = p.missing_rows()
    if missing.numel():
        if recompute is None:
            raise ValueError(
                f"{missing.numel()} busy rows did not fit the dense backup (capacity "
                f"{p.backup_rows.numel()}); pass recompute= to rebuild them exactly"
            )
        dense[missing] = _bits(recompute(missing).to(p.values.dtype))
    return dense.contiguous().view(p.values.dtype)
