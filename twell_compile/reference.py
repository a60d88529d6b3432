"""Plain-PyTorch oracles: what every kernel must compute. Used by tests and benchmarks.

``act`` names the activation (``ACTS``): "relu" h = relu(g) [* u]; "relu2" (squared ReLU)
h = relu(g)^2 [* u]; "drelu" (gated only) h = relu(g) * relu(u). Every one is zero where
relu(g) is: the sparse paths list the non-zeros of relu(g) and form h from relu(g) and u there.
``ffn_dense`` is the model's own computation (the same calls eager PyTorch makes).
``ffn_active_only`` is what the sparse paths promise where the two differ: NaN/Inf weights
or an overflowing up projection at inactive neurons (eager's 0 * Inf = NaN) contribute 0.
``ffn_from_twell`` computes the FFN from TwELL-packed gate activations only (the algorithm of
the fused inference kernels), so tests can check a format and its consumer separately.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from twell_compile.formats import TwELL, pack_twell


ACTS = ("relu", "relu2", "drelu")


def check_act(act: object, gated: bool) -> None:
    """Raise for an activation the ops do not take (``act`` argument, ``ACTS``)."""
    if not isinstance(act, str) or act not in ACTS:
        raise ValueError(f"act must be one of {', '.join(map(repr, ACTS))}, got {act!r}")
    if act == "drelu" and not gated:
        raise ValueError("act='drelu' (relu(gate(x)) * relu(up(x))) needs w_up: a non-gated FFN has no up projection")


def activate(hg: Tensor, hu: Optional[Tensor], act: str = "relu") -> Tensor:
    """h from hg = relu(g) and hu = u (None when non-gated), in the spelling eager runs: the
    square and each product rounded to the dtype."""
    a = hg * hg if act == "relu2" else hg
    if hu is None:
        return a
    return a * (torch.relu(hu) if act == "drelu" else hu)


def ffn_hidden(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
               b_up: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    """(relu(x W_g^T + b_g), x W_u^T + b_u or None)."""
    hg = torch.relu(F.linear(x, w_gate, b_gate))
    hu = None if w_up is None else F.linear(x, w_up, b_up)
    return hg, hu


def ffn_dense(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
              b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor], act: str = "relu") -> Tensor:
    """down(relu(gate(x)) * up(x)), or down(relu(gate(x))) when ``w_up`` is None (``act``: the
    activation, see the module docstring)."""
    hg, hu = ffn_hidden(x, w_gate, b_gate, w_up, b_up)
    return F.linear(activate(hg, hu, act), w_down, b_down)


def ffn_active_only(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                    b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor], act: str = "relu") -> Tensor:
    """The FFN as the sparse paths define it, NaN and Inf included (the non-finite contract,
    docs/cpu.md): a row of x holding NaN/Inf gives eager's result; in every other row an
    inactive neuron (relu(gate) == 0) contributes exactly 0 whatever its up projection or
    W_down column hold, where eager's 0 * Inf would give NaN. x is [M, K]; small sizes only
    (an [M, K_out, N] temporary)."""
    hg, hu = ffn_hidden(x, w_gate, b_gate, w_up, b_up)
    active = hg != 0                                     # NaN != 0: active
    h = torch.where(active, activate(hg, hu, act), torch.zeros((), dtype=hg.dtype))
    terms = torch.where(active.unsqueeze(-2), h.unsqueeze(-2) * w_down, torch.zeros((), dtype=h.dtype))
    y = terms.sum(-1) if b_down is None else terms.sum(-1) + b_down
    finite = torch.isfinite(x).all(-1, keepdim=True)
    return torch.where(finite, y.to(x.dtype), ffn_dense(x, w_gate, b_gate, w_up, b_up, w_down, b_down, act))


def ffn_from_twell(packed: TwELL, x: Tensor, w_up: Optional[Tensor], b_up: Optional[Tensor],
                   w_down: Tensor, b_down: Optional[Tensor], act: str = "relu") -> Tensor:
    """The FFN from packed gate activations relu(g): up and down projections for active pairs
    only, h formed from relu(g) and u there (``act``).

    x is [M, K]. Slots and overflow tiles are disjoint: an overflowing tile is taken wholly
    from ``ovf_values`` and its slots are ignored.
    """
    m, n_tiles, slots = packed.values.shape
    tile_n, n = packed.tile_n, packed.n_cols
    counts = packed.counts
    live = (torch.arange(slots, device=x.device) < counts.unsqueeze(-1)) & (counts <= slots).unsqueeze(-1)
    col = packed.cols.long() + torch.arange(n_tiles, device=x.device).view(1, -1, 1) * tile_n
    rows = torch.arange(m, device=x.device).view(-1, 1, 1).expand_as(col)
    r, c, v = rows[live], col[live], packed.values[live]
    # Overflow tiles, dense: every column of the tile.
    orow = packed.ovf_tiles // n_tiles
    ocol = (packed.ovf_tiles % n_tiles).view(-1, 1) * tile_n + torch.arange(tile_n, device=x.device)
    inside = ocol < n
    r = torch.cat([r, orow.view(-1, 1).expand_as(ocol)[inside]])
    c = torch.cat([c, ocol[inside]])
    v = torch.cat([v, packed.ovf_values[inside]])
    up = None
    if w_up is not None:
        up = (x[r].float() * w_up[c].float()).sum(-1)
        if b_up is not None:
            up = up + b_up[c].float()
    h = activate(v.float(), up, act)
    y = torch.zeros(m, w_down.shape[0], dtype=torch.float32, device=x.device)
    y.index_add_(0, r, h.unsqueeze(-1) * w_down[:, c].t().float())
    if b_down is not None:
        y = y + b_down.float()
    return y.to(x.dtype)


def ffn_twell_reference(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                        b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
                        tile_n: int = 128, slots: int = 16, act: str = "relu") -> Tensor:
    """Gate GEMM + ReLU, TwELL packing, then ``ffn_from_twell``: the sparse algorithm end to end."""
    x2 = x.reshape(-1, x.shape[-1])
    hg = torch.relu(F.linear(x2, w_gate, b_gate))
    y = ffn_from_twell(pack_twell(hg, tile_n, slots), x2, w_up, b_up, w_down, b_down, act)
    return y.reshape(*x.shape[:-1], w_down.shape[0])


def l1_penalty(hidden: list[Tensor], coef: float) -> Tensor:
    """The paper's penalty: coef x mean over tokens, hidden units and layers of |h|."""
    return coef * torch.stack([h.abs().float().mean() for h in hidden]).mean()


def pack_tiles(g: Tensor, tile_n: int, slots: int) -> tuple[Tensor, Tensor]:
    """What twell::gate_pack's epilogue writes beside g [M, N]: (tcnt [M, T] int32, the non-zeros
    of relu(g) per row and tile of ``tile_n`` columns, NaN counted; packed [M, T, slots] int32,
    each one's first ``slots`` non-zeros in column order as (column << 16) | bits(value), -1 in
    the slots past the count, which the kernel leaves unwritten)."""
    m, n = g.shape
    t = -(-n // tile_n)
    v = torch.relu(g)                                   # NaN kept
    nz = torch.zeros((m, t * tile_n), dtype=torch.bool, device=g.device)
    nz[:, :n] = (v != 0)
    nz = nz.view(m, t, tile_n)
    tcnt = nz.sum(2, dtype=torch.int32)
    bits = g.view(torch.int16).int() & 0xFFFF          # g's own bits where relu(g) != 0
    word = torch.full((m, t * tile_n), -1, dtype=torch.int32, device=g.device)
    word[:, :n] = (torch.arange(n, device=g.device, dtype=torch.int32) << 16) | bits
    rank = torch.cumsum(nz.int(), 2) - 1
    packed = torch.full((m, t, slots), -1, dtype=torch.int32, device=g.device)
    keep = nz & (rank < slots)
    rows, tiles_, cols = keep.nonzero(as_tuple=True)
    packed[rows, tiles_, rank[rows, tiles_, cols]] = word.view(m, t, tile_n)[rows, tiles_, cols]
    return tcnt, packed
