"""The block checks of grouped (MoE experts) FFNs, whose projections are ``torch._grouped_mm``
calls (``Projection.offs``): all three grouped with the same expert offsets, and a row
``masked_fill`` of the gate/up output before the activation dropped only where the down
projection's output is masked the same way (``masked_rows_problem``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import fx

from twell_compile.passes.alias import alias_roots, written
from twell_compile.passes.pass_utils import describe, example, shape_key
from twell_compile.passes.projections import Projection, masked_fill_parts


def _zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def _row_mask(node: fx.Node, mask: Any) -> bool:
    """Whether ``mask`` is a boolean mask that takes whole rows of ``node``'s [S, N] output
    (its last dim 1 or none) and does not broadcast that output to another shape."""
    me, out, src = example(mask), example(node), example(node.args[0] if node.args else None)
    if me is None or out is None or src is None or me.dtype != torch.bool:
        return False
    return (me.dim() == 0 or str(me.shape[-1]) == "1") and me.dim() <= out.dim() and shape_key(out) == shape_key(src)


def masked_rows_problem(down_node: fx.Node, projections: list[Optional[Projection]]) -> Optional[str]:
    """Why a grouped block whose gate/up output is masked before the activation
    (``masked_fill(out, mask, 0)``: transformers' expert-parallel sentinel rows) cannot drop
    that masking, or None.

    Dropping it keeps the block's value when every masked_fill zeros whole rows with one mask
    node, the down projection's only user zeros the same rows with the same mask (that one
    stays, on the twell op's output), and nothing writes into the mask in between: a grouped
    matmul and the activation work row by row, so a masked row's output is overwritten by
    zeros either way, and the zero gradient the last masked_fill passes back for it adds
    nothing to any weight's gradient (the row's values being finite)."""
    masked = list(dict.fromkeys(p.masked for p in projections if p is not None and p.masked is not None))
    if not masked:
        return None
    masks = []
    for node in masked:
        _, mask, value = masked_fill_parts(node)
        if not _zero(value):
            return f"a grouped projection's output is masked_fill-ed with {value!r} before the activation, not 0"
        if not _row_mask(node, mask):
            return "a grouped projection's output is masked_fill-ed by a mask that is not one value per row"
        masks.append(mask)
    if len(set(masks)) != 1:
        return "the grouped gate and up outputs are masked_fill-ed by different masks"
    mask = masks[0]
    after = next(iter(down_node.users)) if len(down_node.users) == 1 else None
    parts = masked_fill_parts(after)
    if parts is None or parts[0] is not down_node or parts[1] is not mask or not _zero(parts[2]) \
            or not _row_mask(after, mask):
        return ("the grouped projections' output rows are masked_fill-ed before the activation but the down "
                "projection's output is not masked_fill-ed with 0 by the same mask")
    nodes = list(down_node.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    mask_roots, mask_external = alias_roots(mask)
    for n in nodes[min(order[m] for m in masked):order[after]]:
        for target in written(n):
            roots, external = alias_roots(target)
            if (external and mask_external) or roots & mask_roots:
                return (f"a tensor that may alias the row mask is modified in place ({describe(n)} on "
                        f"{target.name}) between the masked_fill calls")
    return None


def grouped_problem(down_node: fx.Node, gate: Projection, up: Optional[Projection],
                    down: Projection) -> Optional[str]:
    """Why a block with grouped projections must not be rewritten, or None (also for a block
    of plain projections only): grouped and plain mixed, different expert offsets, or a
    masking before the activation that the rewrite cannot drop (``masked_rows_problem``)."""
    grouped = [p.offs for p in (gate, up, down) if p is not None]
    if not any(o is not None for o in grouped):
        return None
    if any(o is None for o in grouped):
        return "mixes grouped (per-expert) and plain projections"
    if len(set(grouped)) != 1:
        return "its grouped projections take different expert offsets"
    return masked_rows_problem(down_node, [gate, up])
