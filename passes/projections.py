"""Recognising linear projections in an FX graph: ``Projection`` (out = x W^T + b, W in
nn.Linear layout) from any spelling of a linear map (``F.linear``, ``x @ w.t()``,
``torch.matmul``, ``addmm``, matmul plus a per-feature bias add), from grouped matmuls
(``torch._grouped_mm``: MoE experts, one map per expert, also seen through an out-of-place
row ``masked_fill`` of the output), and one row range of a fused projection split by
``chunk``, ``split`` or slicing (``resolve_projection``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import fx

from twell_compile.passes.pass_utils import (ADD_FNS, ADD_METHODS, CHUNK_FNS, LINEAR_FNS, MATMUL_FNS, MATMUL_METHODS,
                                             arg, chain, example, is_fn, is_method, shape_key, skip)


@dataclass
class Projection:
    """A linear map out = x W^T + b found in the graph, with W in nn.Linear layout [N, K].

    ``weight`` is the graph node holding the weight; ``transposed`` says it is stored [K, N]
    (e.g. ``x @ W`` or GPT-2's Conv1D) and needs a ``.t()``. ``rows`` selects a row range of
    the [N, K] weight (a fused gate+up projection split in two).
    """

    out: fx.Node                     # the node whose value is x W^T + b
    x: fx.Node
    weight: fx.Node
    bias: Optional[fx.Node]
    transposed: bool
    nodes: list[fx.Node]            # graph nodes making up this projection (besides x, W, b)
    rows: Optional[tuple[int, int]] = None
    whole: Optional[fx.Node] = None  # with ``rows``: the node holding the whole fused projection
    # A grouped projection (MoE experts, ``torch._grouped_mm``): the node holding each expert's
    # cumulative end row; ``weight`` is then [E, N, K] (one [N, K] map per expert; ``transposed``:
    # stored [E, K, N]) and ``rows`` selects rows of each expert's map.
    offs: Optional[fx.Node] = None
    # A grouped projection whose output reaches the activation through ``masked_fill(out, mask,
    # value)`` (transformers' expert-parallel sentinel rows): that masked_fill node, part of
    # ``nodes``; ``check_block`` decides whether dropping it keeps the block's value.
    masked: Optional[fx.Node] = None

    @property
    def width(self) -> Any:
        """Output features of the whole projection (all rows of the [N, K] weight)."""
        w = example(self.weight)
        return w.shape[-1] if self.transposed else w.shape[-2]


def per_feature(b: torch.Tensor, width: Any) -> bool:
    """Whether a bias broadcasts as one value per output feature: [width], [1], 0-d, or those
    with leading 1s ([1, width])."""
    return b.dim() == 0 or (all(str(d) == "1" for d in b.shape[:-1]) and str(b.shape[-1]) in ("1", str(width)))


# Dynamo up to torch 2.13 traces w.T / w.mT as getattr; torch 2.14 as these ops
_ATTR_TRANSPOSES = frozenset(op for name in ("numpy_T", "mT") for op in (
    getattr(torch.ops.aten, name, None), getattr(getattr(torch.ops.aten, name, None), "default", None))
    if op is not None)


def _transpose_source(w: Any) -> Optional[fx.Node]:
    """If w is the transpose of a 2-D tensor, that tensor."""
    if not isinstance(w, fx.Node):
        return None
    if w.op == "call_function" and w.target is getattr and w.args[1] in ("T", "mT"):
        return w.args[0]
    if w.op == "call_function" and w.target in _ATTR_TRANSPOSES:   # w.T / w.mT from torch 2.14's Dynamo
        return w.args[0]
    if is_method(w, {"t"}) or is_fn(w, {torch.t}):
        return w.args[0]
    if is_method(w, {"transpose"}) or is_fn(w, {torch.transpose}):
        dims = {d % 2 for d in w.args[1:3] if isinstance(d, int)}
        return w.args[0] if dims == {0, 1} else None
    if is_method(w, {"permute"}) or is_fn(w, {torch.permute}):
        dims = w.args[1:] if not isinstance(w.args[1], (tuple, list)) else w.args[1]
        return w.args[0] if tuple(dims) in ((1, 0), (-1, -2)) else None
    return None


def bias_add(node: fx.Node) -> Optional[tuple[fx.Node, fx.Node]]:
    """If ``node``'s only user adds a per-feature bias of its own dtype to it ([N], or one value
    broadcast: [1], 0-d) without broadcasting it to a larger shape: (add node, bias node)."""
    if len(node.users) != 1:
        return None
    add = next(iter(node.users))
    if not (is_fn(add, ADD_FNS) or is_method(add, ADD_METHODS)) or len(add.args) != 2 or add.kwargs:
        return None
    a, b = add.args
    other = b if a is node else a
    t, out, total = example(other), example(node), example(add)
    if t is None or out is None or total is None or out.dim() < 1 or not per_feature(t, out.shape[-1]):
        return None
    if t.dtype != out.dtype:
        # add promotes by its own rules (a 0-d fp32 keeps bf16, an fp32 [N] makes fp32, autocast
        # aside): the add stays after the projection, exactly as eager runs it
        return None
    if shape_key(total) != shape_key(out):
        return None
    return add, other


_GROUPED_MM_FNS = {f for f in (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)) if f is not None}
# transformers' fallback for grouped_mm (fp32 under torch.compile), registered when its MoE
# integration is imported: recognised by its qualified name, not imported here
_GROUPED_MM_OPS = {"transformers::grouped_mm_fallback"}


def is_grouped_mm(node: fx.Node) -> bool:
    """``torch._grouped_mm`` / ``F.grouped_mm`` / transformers' ``grouped_mm_fallback`` op."""
    if node.op != "call_function":
        return False
    if node.target in _GROUPED_MM_FNS:
        return True
    name = getattr(node.target, "_qualified_op_name", None) or (node.target.name() if isinstance(
        node.target, torch._ops.OpOverload) else None)
    return name in _GROUPED_MM_OPS


def _grouped_projection(node: fx.Node) -> Optional[Projection]:
    """``grouped_mm(x [S, K], W [E, K, N], offs)`` without bias or output dtype: the experts'
    projection, W either a transpose of an [E, N, K] parameter (transformers' layout) or stored
    [E, K, N]."""
    x, w = arg(node, 0, "input", arg(node, 0, "mat_a")), arg(node, 1, "weight", arg(node, 1, "mat_b"))
    offs = arg(node, 2, "offs")
    if any(arg(node, i, key) is not None for i, key in ((3, "bias"), (4, "out_dtype"))):
        return None
    xe, we = example(x), example(w)
    if not isinstance(offs, fx.Node) or xe is None or we is None or xe.dim() != 2 or we.dim() != 3:
        return None
    src = None
    if is_method(w, {"transpose"}) or is_fn(w, {torch.transpose}):
        src = w.args[0] if {d % 3 for d in w.args[1:3] if isinstance(d, int)} == {1, 2} else None
    elif w.op == "call_function" and w.target is getattr and w.args[1] == "mT":
        src = w.args[0]
    if src is not None and example(src) is not None and len(w.users) == 1:
        return Projection(node, x, src, None, False, [node, w], offs=offs)
    return Projection(node, x, w, None, True, [node], offs=offs)


_MASKED_FILL_FNS = {torch.masked_fill}


def masked_fill_parts(node: Any) -> Optional[tuple[fx.Node, Any, Any]]:
    """If ``node`` is an out-of-place ``masked_fill(src, mask, value)`` (method or function) of a
    tensor: (src, mask, value)."""
    if not isinstance(node, fx.Node) or not (is_method(node, {"masked_fill"}) or is_fn(node, _MASKED_FILL_FNS)):
        return None
    src, mask, value = arg(node, 0, "input"), arg(node, 1, "mask"), arg(node, 2, "value")
    if not isinstance(src, fx.Node):
        return None
    return src, mask, value


def _masked_grouped_projection(node: Any) -> Optional[Projection]:
    """A grouped projection seen through an out-of-place ``masked_fill`` of its output (and
    identity-like nodes between): the projection with ``masked`` set, else None. Only grouped
    projections: the masked rows are then whole routed rows, which ``check_block`` can prove
    are zeroed again after the down projection."""
    parts = masked_fill_parts(node)
    if parts is None:
        return None
    inner = skip(parts[0])
    p = as_projection(inner)
    if p is None or p.offs is None or p.out is not inner:
        return None
    p.masked = node
    p.nodes = p.nodes + [node] + chain(parts[0], inner)
    return p


def as_projection(node: Any) -> Optional[Projection]:
    """Recognise ``node`` as the output of a linear map (its bias add included), else None."""
    if not isinstance(node, fx.Node):
        return None
    if is_grouped_mm(node):
        return _grouped_projection(node)
    # A bias add on top of a matmul: look through it.
    if (is_fn(node, ADD_FNS) or is_method(node, ADD_METHODS)) and len(node.args) == 2:
        for inner in node.args:
            if isinstance(inner, fx.Node):
                p = as_projection(inner)
                if p is not None and p.bias is None and p.out is inner:
                    hit = bias_add(inner)
                    if hit is not None and hit[0] is node:
                        p.bias, p.out = hit[1], node
                        p.nodes.append(node)
                        return p
        return None
    if is_fn(node, LINEAR_FNS):
        x, w, b = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")
        if example(w) is None or example(w).dim() != 2:
            return None
        return Projection(node, x, w, b, False, [node])
    if is_fn(node, MATMUL_FNS) or is_method(node, MATMUL_METHODS):
        x, w = node.args[0], node.args[1]
        if example(w) is None or example(w).dim() != 2 or example(x) is None or example(x).dim() < 1:
            return None
        src = _transpose_source(w)
        if src is not None and example(src) is not None and example(src).dim() == 2 and len(w.users) == 1:
            return Projection(node, x, src, None, False, [node, w])
        return Projection(node, x, w, None, True, [node])
    if is_fn(node, {torch.addmm}):
        b, x, w = node.args[:3]
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return None
        if example(b) is None or example(w) is None or example(w).dim() != 2:
            return None
        src = _transpose_source(w)
        if src is not None and example(src) is not None and len(w.users) == 1:
            return Projection(node, x, src, b, False, [node, w])
        return Projection(node, x, w, b, True, [node])
    return None


def _split_part(node: fx.Node) -> Optional[tuple[fx.Node, int, int]]:
    """If node is a last-dim slice of another tensor: (source, start, stop) in columns."""
    if not (node.op == "call_function" and node.target is operator.getitem):
        return None
    src, idx = node.args
    ev = example(node)
    if ev is None:
        return None
    # chunk / split / tensor_split along the last dim, then getitem(i)
    if isinstance(idx, int) and isinstance(src, fx.Node) and (
            is_fn(src, CHUNK_FNS) or is_method(src, {"chunk", "split", "tensor_split"})):
        base = src.args[0]
        bt = example(base)
        if bt is None:
            return None
        dim = arg(src, 2, "dim", 0)
        if not isinstance(dim, int) or dim % bt.dim() != bt.dim() - 1:
            return None
        parts = src.meta.get("example_value")
        if not isinstance(parts, (tuple, list)):
            return None
        widths = [int(p.shape[-1]) for p in parts]
        start = sum(widths[:idx])
        return base, start, start + widths[idx]
    # slicing x[..., a:b] or x[:, :, a:b]
    if isinstance(src, fx.Node) and isinstance(idx, (tuple, slice)):
        st = example(src)
        if st is None:
            return None
        items = idx if isinstance(idx, tuple) else (idx,)
        if Ellipsis in items:
            if items[:-1] != (Ellipsis,):
                return None
        elif len(items) != st.dim() or any(s != slice(None) for s in items[:-1]):
            return None
        last = items[-1]
        if not isinstance(last, slice) or last.step not in (None, 1):
            return None
        width = int(st.shape[-1])
        start, stop, _ = last.indices(width)
        return src, start, stop
    return None


def _split_nodes(node: fx.Node) -> list[fx.Node]:
    nodes = [node]
    src = node.args[0]
    if is_fn(src, CHUNK_FNS) or is_method(src, {"chunk", "split", "tensor_split"}):
        nodes.append(src)
    return nodes


def resolve_projection(node: Any) -> Optional[Projection]:
    """A projection, possibly one half of a fused projection split by columns."""
    node = skip(node)
    p = as_projection(node) or _masked_grouped_projection(node)
    if p is not None:
        return p
    if not isinstance(node, fx.Node):
        return None
    part = _split_part(node)
    if part is None:
        return None
    base, start, stop = part
    inner = skip(base)
    p = as_projection(inner) or _masked_grouped_projection(inner)
    if p is None:
        return None
    p.whole, p.out = p.out, node
    p.nodes = p.nodes + chain(base, inner) + _split_nodes(node)
    p.rows = (start, stop)
    return p
