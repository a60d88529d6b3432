"""Exact plain-PyTorch implementations of the twell ops (any device; the CPU path today).

Inference computes densely, in the same calls eager PyTorch makes, so results match eager
bit for bit. Training saves the hidden activations in the hybrid format (ELL + fixed-capacity
dense backup) and its backward rebuilds them from that format, recomputing exactly the busy
rows the backup could not hold, so the format is exercised on every training step.

The saved pairs are those where h is non-zero: relu(g)'s non-zeros for ReLU and squared ReLU,
and for dReLU (h = relu(g) relu(u)) only the columns where both factors are non-zero. Both of
dReLU's derivatives (d_g = dh relu(u) [g > 0], d_u = dh relu(g) [u > 0]) and the L1 term's
sign(h) vanish at the other columns, so the backward is the same without them. The layer's
statistics and the L1 controller count relu(g)'s non-zeros on every path (the CUDA kernels'
state keeps relu(g)'s pairs: their lists are built before u is known).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from twell_compile import stats
from twell_compile.formats import Hybrid, backup_capacity, ell_width_for, nonzero_mask, pack_hybrid, unpack_hybrid
from twell_compile.reference import activate, ffn_hidden


def ffn_infer(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
              b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
              layer: str, keep_stats: bool, act: str = "relu") -> Tensor:
    hg, hu = ffn_hidden(x, w_gate, b_gate, w_up, b_up)
    h = activate(hg, hu, act)
    if keep_stats:
        m, n = math.prod(h.shape[:-1]), h.shape[-1]     # (reshape(-1, n) is ambiguous at N = 0)
        counts = nonzero_mask(hg.reshape(m, n)).sum(-1)
        stats.record(layer, counts, h.abs().float().sum(), counts.new_zeros(()), n)
    return F.linear(h, w_down, b_down)


def ffn_train_forward(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                      b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
                      ell_width: int, backup_rows: int, layer: str, keep_stats: bool, act: str = "relu"
                      ) -> tuple[Tensor, ...]:
    """Returns y, the saved state: counts, cols, ell_g, ell_u, backup_idx, backup_g, backup_u
    (relu(g) and u at h's non-zeros: relu(g)'s, for dReLU where relu(u) is non-zero too), and
    the per-row non-zero counts of relu(g) (what the statistics and the L1 controller count)."""
    k = x.shape[-1]
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    m, n = x2.shape[0], w_gate.shape[0]
    hg, hu = ffn_hidden(x2, w_gate, b_gate, w_up, b_up)
    h = activate(hg, hu, act)
    y = F.linear(h, w_down, b_down)
    width = ell_width_for(ell_width, n)
    fired = nonzero_mask(hg)
    gate_counts = fired.sum(-1, dtype=torch.int32)
    # dReLU: relu(g) only where h's value is non-zero too (NaN kept; masked_fill writes +0.0,
    # which packing skips, where relu(u) is zero)
    kept = hg.masked_fill((h == 0) & ~h.isnan(), 0) if act == "drelu" else hg
    hyb = pack_hybrid(kept, width, backup_capacity(m, backup_rows))
    # with no rows (M = 0) the backup is all padding (-1), and row 0 does not exist to index
    filled = hyb.backup_rows >= 0
    rows = hyb.backup_rows.clamp(min=0) if m else None
    if hu is None:
        ell_u, backup_u = hg.new_empty(m, 0), hg.new_empty(hyb.backup.shape[0], 0)
    else:
        live = torch.arange(width, device=x.device) < hyb.counts.unsqueeze(-1)
        ell_u = torch.where(live, hu.gather(1, hyb.cols.long()), torch.zeros((), dtype=hu.dtype, device=hu.device))
        backup_u = (torch.where(filled.unsqueeze(-1), hu[rows], torch.zeros((), dtype=hu.dtype, device=hu.device))
                    if m else hu.new_zeros(hyb.backup.shape))
    if keep_stats:
        busy = hyb.counts > width
        stored = busy.new_zeros(busy.shape)
        if m:
            stored[rows] = filled
        stats.record(layer, gate_counts, h.abs().float().sum(), (busy & ~stored).sum(), n)
        stats.record_fired(layer, fired.any(0), m)
    out = (y.reshape(*x.shape[:-1], w_down.shape[0]), hyb.counts, hyb.cols, hyb.values, ell_u,
           hyb.backup_rows, hyb.backup, backup_u, gate_counts)
    return tuple(t.contiguous() for t in out)


def ffn_train_backward(dy: Tensor, x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor],
                       w_up: Optional[Tensor], b_up: Optional[Tensor], w_down: Tensor,
                       counts: Tensor, cols: Tensor, ell_g: Tensor, ell_u: Tensor,
                       backup_idx: Tensor, backup_g: Tensor, backup_u: Tensor, l1_scale: float,
                       act: str = "relu", l1_coef: Optional[Tensor] = None, db_down: bool = True
                       ) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor], Tensor,
                                  Optional[Tensor]]:
    """Gradients (dx, dw_gate, db_gate, dw_up, db_up, dw_down, db_down), as dense autograd
    (``db_down`` False: db_down None).

    ``l1_scale`` adds the gradient of ``l1_scale * mean(|h|)`` (mean over this call's tokens and
    hidden units) for h the activation fed to the down projection; the backend passes coef /
    layers. ``l1_coef`` (a [1] device tensor: the controller's coefficient) multiplies it, read
    on the device. With a = relu(g)^2 (relu2) or relu(g), b = relu(u) (drelu) or u: d_g = dh b
    a'(g) (a' = 2 relu(g) or 1, zero where relu(g) is), d_u = dh a b'(u), as autograd takes them.
    """
    k, n = x.shape[-1], w_gate.shape[0]
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    dy2 = dy.reshape(x2.shape[0], dy.shape[-1])
    gated = w_up is not None

    def gate_rows(rows: Tensor) -> Tensor:
        return torch.relu(F.linear(x2[rows], w_gate, b_gate))

    def up_rows(rows: Tensor) -> Tensor:
        return F.linear(x2[rows], w_up, b_up)

    hg = unpack_hybrid(Hybrid(ell_g, cols, counts, backup_idx, backup_g), n, gate_rows)
    hu = unpack_hybrid(Hybrid(ell_u, cols, counts, backup_idx, backup_u), n, up_rows) if gated else None
    a = hg * hg if act == "relu2" else hg
    b = (torch.relu(hu) if act == "drelu" else hu) if gated else None
    h = a * b if gated else a
    dw_down = dy2.t().mm(h)
    db_down = dy2.sum(0) if db_down else None
    dh = dy2.mm(w_down)
    if l1_scale:
        if l1_coef is None:
            dh = dh + torch.sgn(h) * (l1_scale / max(h.numel(), 1))
        else:
            dh = dh + torch.sgn(h) * (l1_coef.float() * (l1_scale / max(h.numel(), 1))).to(dh.dtype)
    d_a, d_up = (dh * b, dh * a) if gated else (dh, None)
    if act == "drelu":      # 0 where relu(u) is, at relu(g)'s non-zeros (kernels/act.py: dh * 0 elsewhere)
        d_up = torch.where((hu <= 0) & (hg > 0), torch.zeros((), dtype=d_up.dtype), d_up)
    if act == "relu2":
        d_a = d_a * (2 * hg)
    d_gate = torch.ops.aten.threshold_backward(d_a, hg, 0)
    dx = d_gate.mm(w_gate)
    dw_gate = d_gate.t().mm(x2)
    db_gate = d_gate.sum(0) if b_gate is not None else None
    dw_up = db_up = None
    if gated:
        dx = dx + d_up.mm(w_up)
        dw_up = d_up.t().mm(x2)
        db_up = d_up.sum(0) if b_up is not None else None
    return dx.reshape(x.shape), dw_gate, db_gate, dw_up, db_up, dw_down, db_down
