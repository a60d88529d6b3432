"""Finds ReLU feed-forward blocks in a Dynamo (torch-level) FX graph. Analysis only.

A match is ``down(relu(gate(x)) * up(x))`` or ``down(relu(up(x)))``, or the same with squared
ReLU (``relu(.) ** 2`` in any spelling: ``squared_relu``) in place of ReLU, or dReLU
``down(relu(gate(x)) * relu(up(x)))``; ``Match.act`` says which. Each projection is
any spelling of a linear map (``F.linear``, ``x @ w.t()``, ``torch.matmul``, ``addmm``, matmul
plus bias add), the gate and up may come from one fused projection split by ``chunk``,
``split`` or slicing, and identity-like nodes (eval-mode dropout, ``contiguous``, same-dtype
casts, reshapes that keep the last dimension) may sit in between. Grouped (MoE experts)
projections may reach the activation through ``masked_fill(out, row_mask, 0)`` when the down
projection's output is masked the same way (``_masked_rows_problem``).

Biases may be [N] or broadcast as one value per feature ([1], 0-d, [1, N]; the rewrite
expands them). FFN-shaped blocks that are *not* rewritten come back as rejections with a plain
reason, among them blocks with an in-place write between their first read and the down
projection into anything that may share storage with the input, a weight or a bias (alias
analysis over the graph: only writes into fresh tensors pass), and blocks inside a torch.func
transform or forward-mode AD (``transform_regions``, ``dual_inputs``).
"""

from __future__ import annotations

import inspect
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import fx

from twell_compile.passes.pass_utils import (ACTIVATION_METHODS, ACTIVATIONS, ADD_FNS, ADD_METHODS, CHUNK_FNS,
                                             DROPOUT_FNS, LINEAR_FNS, MATMUL_FNS, MATMUL_METHODS, MUL_FNS,
                                             MUL_METHODS, RELU_FNS, RELU_METHODS, arg, chain, example, is_fn,
                                             is_method, real_value, shape_key, skip)
from twell_compile.report import ROOT_LAYER
from twell_compile.ops import caller_modules


def is_relu(node: fx.Node) -> bool:
    return is_fn(node, RELU_FNS) or is_method(node, RELU_METHODS)


_INPLACE_FNS = {torch.relu_, F.relu_, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                operator.ilshift, operator.irshift, operator.imatmul, operator.setitem}
_NOT_INPLACE_METHODS = {"requires_grad_", "__setitem__"}
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                    "__imatmul__"}


def mutates_first_arg(node: fx.Node) -> bool:
    """Whether ``node`` writes into its first argument (``relu_``, ``inplace=True``, ``x *= y``)."""
    if node.op == "call_method":
        name = str(node.target)
        return (name.endswith("_") and not name.endswith("__") and name not in _NOT_INPLACE_METHODS) or name in _INPLACE_DUNDERS
    if node.op == "call_function":
        if node.target in _INPLACE_FNS:
            return True
        name = getattr(node.target, "__name__", "")
        if isinstance(name, str) and name.endswith("_") and not name.endswith("__") and name not in _NOT_INPLACE_METHODS:
            return True      # torch.relu_, torch.nn.init.normal_, torch.Tensor.add_ called as a function
        return node.kwargs.get("inplace") is True or _inplace_positional(node)
    return False


_INPLACE_POSITION: dict[Any, Optional[int]] = {}


def _inplace_index(fn: Any) -> Optional[int]:
    """Position of a Python function's ``inplace`` parameter (F.relu: 1, F.dropout: 3), else None."""
    try:
        if fn in _INPLACE_POSITION:
            return _INPLACE_POSITION[fn]
    except TypeError:            # unhashable target
        return None
    try:
        params = list(inspect.signature(fn).parameters)
        index = params.index("inplace") if "inplace" in params else None
    except (TypeError, ValueError):   # builtins without a signature
        index = None
    _INPLACE_POSITION[fn] = index
    return index


def _inplace_positional(node: fx.Node) -> bool:
    """``F.relu(x, True)``, ``F.dropout(x, 0.1, False, True)``: an ``inplace`` flag given by position."""
    i = _inplace_index(node.target)
    return i is not None and len(node.args) > i and node.args[i] is True


def _flat_nodes(value: Any) -> list[fx.Node]:
    """The graph nodes in an argument (nested lists, tuples and dicts included)."""
    out: list[fx.Node] = []
    fx.node.map_arg(value, out.append)
    return out


def written(node: fx.Node) -> list[fx.Node]:
    """The graph values ``node`` writes into: in-place methods and functions (their first
    argument), ``inplace=True``, ``out=``, ``setitem``, ``copy_``, ATen overloads whose schema
    marks an argument written. Empty for a node that mutates nothing."""
    if node.op not in ("call_function", "call_method"):
        return []
    out: list[fx.Node] = []
    if "out" in node.kwargs:
        out += _flat_nodes(node.kwargs["out"])
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is None and isinstance(target, torch._ops.OpOverloadPacket):
        schemas = [getattr(target, o)._schema for o in target.overloads()]
    else:
        schemas = [schema] if schema is not None else []
    for sch in schemas:
        for i, a in enumerate(sch.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
                out += _flat_nodes(v)
    if isinstance(target, torch._ops.HigherOrderOperator) and "mutation" in str(getattr(target, "__name__", target)):
        out += _flat_nodes((node.args, node.kwargs))
    if mutates_first_arg(node) and node.args:
        out += _flat_nodes(node.args[0])
    return list(dict.fromkeys(out))


# Calls whose result is a new tensor, never a view of (or the same tensor as) an argument.
_FRESH_FNS = {
    torch._C._nn.linear, F.linear, operator.matmul, torch.matmul, torch.mm, torch.bmm, torch.addmm,
    torch.baddbmm, torch.einsum, torch.clone, torch.cat, torch.concat, torch.stack, torch.where,
    torch.zeros, torch.ones, torch.empty, torch.full, torch.rand, torch.randn, torch.randint, torch.arange,
    torch.tensor, torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
    torch.randn_like, torch.relu, F.relu, F.silu, F.gelu, F.softmax, F.layer_norm, F.rms_norm, torch.tanh,
    torch.sigmoid, F.sigmoid, F.tanh, torch.exp, torch.sqrt, torch.rsqrt, torch.square, torch.abs, torch.erf,
    torch.neg, torch.pow, torch.maximum, torch.minimum, torch.clamp, torch.sum, torch.mean,
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div,
}
_FRESH_METHODS = {
    "clone", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "matmul", "mm", "__matmul__",
    "mul", "add", "sub", "div", "neg", "pow", "relu", "sigmoid", "tanh", "exp", "sqrt", "rsqrt", "square",
    "abs", "clamp", "softmax", "sum", "mean", "__mul__", "__add__", "__sub__", "__truediv__", "__rmul__",
    "__radd__", "__rsub__", "__rtruediv__", "__neg__", "__pow__",
}


_RESTORAGE = {"set_", "_set_data", "swap_tensors"}    # calls that make a tensor share another's storage


def _fresh(node: fx.Node) -> bool:
    """Whether ``node``'s value is a newly allocated tensor (no alias of anything before it)."""
    if node.op == "call_function":
        known = node.target in _FRESH_FNS
    elif node.op == "call_method":
        known = node.target in _FRESH_METHODS
    else:
        return False
    if not known or written(node) or node.kwargs.get("inplace") is True:
        return False
    # ``t.set_(x)`` later makes even a fresh tensor share x's storage.
    return not any(str(getattr(u.target, "__name__", u.target)) in _RESTORAGE for u in node.users)


def alias_roots(node: Any, limit: int = 200) -> tuple[set[fx.Node], bool]:
    """What ``node``'s value may share storage with: (fresh tensors made in the graph, whether
    anything else: a graph input, a get_attr, a module's state, more than ``limit`` steps).
    Follows every argument of every call not known to allocate (views, ``.data``, in-place
    ops returning their input, unknown calls)."""
    roots: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    external = False
    todo = [node]
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if len(seen) > limit:
            return roots, True
        if _fresh(n):
            roots.add(n)
            continue
        inputs = _flat_nodes((n.args, n.kwargs))
        if n.op not in ("call_function", "call_method") or not inputs:
            external = True      # placeholder, get_attr, call_module, or a call that reads no tensor
        todo += inputs
    return roots, external


def activation_name(node: fx.Node) -> Optional[str]:
    """Name of a known non-ReLU activation, else None."""
    if node.op == "call_function":
        name = ACTIVATIONS.get(node.target)
        if name is None and node.target in (torch.nn.functional.gelu,):
            name = "GELU"
        return name
    if node.op == "call_method":
        return ACTIVATION_METHODS.get(node.target)
    if node.op == "call_module":
        return str(node.target)
    return None


# ------------------------------------------------------------------------------ projections
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


def _bias_add(node: fx.Node) -> Optional[tuple[fx.Node, fx.Node]]:
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
                    hit = _bias_add(inner)
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


# ------------------------------------------------------------------------------ matches
@dataclass
class Rejection:
    """An FFN-shaped block left to Inductor, with the reason."""
    down: fx.Node
    reason: str
    layer: str = ""


@dataclass
class Match:
    down: Projection
    gate: Projection
    up: Optional[Projection]
    x: fx.Node
    internal: list[fx.Node] = field(default_factory=list)   # nodes the rewrite removes
    layer: str = ""
    act: str = "relu"        # the op's ``act``: "relu", "relu2" (squared ReLU), "drelu" (reference.ACTS)

    @property
    def gated(self) -> bool:
        return self.up is not None


def _describe(node: Any) -> str:
    if not isinstance(node, fx.Node):
        return repr(node)
    act = activation_name(node)
    if act:
        return act
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return f"{node.op} {node.target}"


# Dynamo names a module by the source it was reached through: the compiled callable's own
# argument (L['self'], L['mod'], or L['args'][0] where a decorator wraps forward, as in
# transformers 5.24), or a global (G['model']), then the attribute path from there.
SELF_ROOT = "L['self']"          # the source root of a module frame's own module
_ROOT_SOURCE = re.compile(r"""^[LG]\[(?:'[^']*'|"[^"]*")\](?:\[[^\]]*\])*""")


def source_root(source: str) -> str:
    """The root of a Dynamo source (``L['self']`` of ``L['self'].model.layers[0]``); "" for
    an fx / export path, which has none."""
    m = _ROOT_SOURCE.match(source)
    return m.group(0) if m else ""


def module_path(source: str) -> str:
    """The module path (``model.layers.0.mlp``) of a Dynamo module source, whatever its root:
    ``L['self'].model.layers[0].mlp``, ``L['args'][0]._modules['model'].layers.0.mlp`` and
    ``G['net'].model.layers.0.mlp`` all give ``model.layers.0.mlp``."""
    rest = _ROOT_SOURCE.sub("", source, count=1)
    rest = re.sub(r"""\._(?:modules|parameters|buffers)\[(?:'([^']*)'|"([^"]*)")\]""", lambda m: "." + (m.group(1) or m.group(2)), rest)
    rest = re.sub(r"""\[(?:'([^']*)'|"([^"]*)"|(-?\d+))\]""", lambda m: "." + next(g for g in m.groups() if g is not None), rest)
    return rest.lstrip(".")


def layer_name(nodes: list[fx.Node], roots: Optional[dict[str, str]] = None) -> str:
    """The innermost module path shared by the projections (e.g. 'model.layers.0.mlp'); "root"
    (report.ROOT_LAYER) when they share none: the compiled model's own forward holds them.

    Paths are compared as module paths, whatever spelling Dynamo gave each source
    (``layers[0]``, ``layers._modules['0']``, ``layers.0``). ``roots`` maps a source root
    (``L['self']``) to that module's own path in the model (``pass_utils.module_roots``): a
    frame Dynamo compiles on its own after a graph break (an inner block's forward) names its
    FFNs as the whole model's frame does."""
    stacks = [list((n.meta.get("nn_module_stack") or {}).values()) for n in nodes]
    common: Optional[str] = None
    for entries in zip(*stacks):
        sources = [e[0] if isinstance(e, tuple) else str(e) for e in entries]
        keys = {(source_root(s), module_path(s)) for s in sources}
        if len(keys) != 1:
            break
        common = sources[0]
    if common is None:       # the frame's own forward: its module's path, when it is a module's
        return (roots or {}).get(SELF_ROOT) or ROOT_LAYER
    prefix = (roots or {}).get(source_root(common), "")
    return ".".join(p for p in (prefix, module_path(common)) if p) or ROOT_LAYER


def module_roots(gm: fx.GraphModule) -> dict[str, str]:
    """For each source root of a Dynamo graph (``L['self']``, ``L['args'][0]``) whose
    parameters it lifts as inputs: that root module's path in the outermost module on the
    call stack that holds those parameters ("" for the model itself). A frame Dynamo compiles
    on its own (a block's forward after a graph break in its caller, gradient checkpointing)
    roots its sources at that block; with this map its FFNs keep the names the whole model's
    frame gives them. Empty where nothing can be told (no lifted parameters, a plain
    function's frame). Computed once per graph (kept in ``gm.meta``)."""
    if "twell_module_roots" in gm.meta:
        return gm.meta["twell_module_roots"]
    params: dict[str, list[tuple[torch.Tensor, str]]] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        t = real_value(gm, node)
        source = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
        if t is None or not isinstance(source, str) or not callable(getattr(t, "data_ptr", None)):
            continue
        root = source_root(source)
        if root and "_parameters[" in source:
            params.setdefault(root, []).append((t, module_path(source)))
    roots: dict[str, str] = {}
    if params:
        for model in caller_modules():
            names = {}
            for name, p in model.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), []).append(name)
            for root, items in params.items():
                if root in roots:
                    continue
                for t, rel in items:
                    found = [n for n in names.get(id(t), ()) if n == rel or n.endswith("." + rel)]
                    if found:
                        roots[root] = found[0][:len(found[0]) - len(rel)].rstrip(".")
                        break
            if len(roots) == len(params):
                break
    gm.meta["twell_module_roots"] = roots
    return roots


def _has_outside_users(internal: list[fx.Node], end: fx.Node) -> Optional[fx.Node]:
    inside = set(internal) | {end}
    for n in internal:
        if n is end:
            continue
        for u in n.users:
            if u not in inside:
                return n
    return None



_ELEMENTWISE_FNS = {operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow,
                    torch.mul, torch.add, torch.sub, torch.div, torch.neg, torch.pow, torch.tanh, torch.sigmoid,
                    torch.erf, torch.exp, torch.sqrt, torch.rsqrt, torch.square, torch.abs, torch.where,
                    torch.maximum, torch.minimum, torch.clamp, F.sigmoid, F.tanh}
_ELEMENTWISE_METHODS = {"mul", "add", "sub", "div", "neg", "pow", "tanh", "sigmoid", "erf", "exp", "sqrt",
                        "rsqrt", "square", "abs", "clamp", "__mul__", "__add__", "__rmul__", "__radd__"}


def composite_activation(node: Any, depth: int = 10) -> Optional[str]:
    """If ``node`` is an elementwise expression of one projection's output (e.g. GPT-2's
    ``0.5 * x * (1 + tanh(...))``): the operator names in it, else None."""
    names: list[str] = []
    sources: set[fx.Node] = set()
    seen: set[fx.Node] = set()

    def walk(n: Any, d: int) -> bool:
        if not isinstance(n, fx.Node):
            return isinstance(n, (int, float, bool))
        n = skip(n)
        if n in seen:
            return True
        seen.add(n)
        if resolve_projection(n) is not None:
            sources.add(n)
            return True
        if d == 0 or not (is_fn(n, _ELEMENTWISE_FNS) or is_method(n, _ELEMENTWISE_METHODS)) or is_relu(n):
            return False
        name = _describe(n)
        if name not in names:
            names.append(name)
        return all(walk(a, d - 1) for a in list(n.args) + list(n.kwargs.values()))

    if isinstance(node, fx.Node) and walk(node, depth) and len(sources) == 1 and names:
        return ", ".join(names)
    return None


def _relu_block(node: Any) -> bool:
    """Whether ``node`` is relu(projection) or its square, or a product with such a factor."""
    node = skip(node)
    if not isinstance(node, fx.Node):
        return False
    if squared_relu(node) is not None:
        return True
    if is_relu(node):
        return bool(node.args) and resolve_projection(node.args[0]) is not None
    if (is_fn(node, MUL_FNS) or is_method(node, MUL_METHODS)) and len(node.args) == 2:
        return any(isinstance(a, fx.Node) and is_relu(skip(a)) and _relu_block(a) for a in node.args)
    return False


def _transformed(down_node: fx.Node, h: fx.Node, reject: Any) -> Optional[Rejection]:
    """A rejection when a ReLU block reaches the down projection through another op (e.g. ReLU²)."""
    if as_projection(h) is not None:
        return None   # linear(relu(...)) feeding this one: a different FFN, or none
    for a in list(h.args) + list(h.kwargs.values()):
        if isinstance(a, fx.Node) and _relu_block(a):
            return reject(down_node, f"the ReLU output goes through {_describe(h)} before the down projection")
    return None


def _mutation_inside(down_node: fx.Node, internal: list[fx.Node],
                     projections: list[Optional[Projection]]) -> Optional[str]:
    """Why the block must not be rewritten because of an in-place write between its first
    read and its down projection, or None."""
    nodes = list(down_node.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    first = min(order[n] for n in internal)
    read_roots: set[fx.Node] = set()
    for i, p in enumerate(projections):
        if p is not None:       # the down projection's input is the block's own value
            for v in ((p.x,) if i < len(projections) - 1 else ()) + (p.weight, p.bias):
                read_roots |= alias_roots(v)[0]
    for n in nodes[first:order[down_node]]:
        for target in written(n):
            roots, external = alias_roots(target)
            # Unrelated only when it can share storage with nothing but fresh tensors the block
            # does not read (an in-place op on one of the block's own intermediate values): a
            # fresh allocation never aliases a graph input or a parameter.
            if not external and not (roots & read_roots):
                continue
            return (f"a tensor that may alias the FFN input or a weight/bias is modified in place "
                    f"({_describe(n)} on {target.name}) inside the block")
    return None


def _bias_problem(p: Optional[Projection], what: str) -> Optional[str]:
    """Why a projection's bias cannot become the op's [N] bias (expanded from [1] or 0-d), or None."""
    if p is None or p.bias is None:
        return None
    b, w = example(p.bias), example(p.weight)
    if b is None or w is None:
        return f"the {what} bias has no recorded shape"
    if not per_feature(b, p.width):
        return (f"the {what} bias has shape {list(b.shape)}, not one value per output feature "
                f"([{p.width}], [1] or 0-d)")
    value, xe = example(p.whole or p.out), example(p.x)
    if value is None or xe is None or shape_key(value) != (*shape_key(xe)[:-1], str(p.width)):
        return f"the {what} bias of shape {list(b.shape)} broadcasts the projection to another shape"
    return None


@dataclass
class _Block:
    """What a matcher found around the down projection, before the block checks."""
    gate: Projection
    up: Optional[Projection]
    relu: fx.Node
    internal: list[fx.Node]
    act: str = "relu"


_POW_FNS = {operator.pow, torch.pow}
_POW_METHODS = {"pow", "__pow__"}
_SQUARE_FNS = {torch.square}
_SQUARE_METHODS = {"square"}


def _exponent(node: fx.Node) -> Any:
    """The exponent of ``x ** e`` / ``torch.pow(x, e)`` / ``x.pow(e)`` when ``node`` is one with a
    tensor base, else None."""
    if not (is_fn(node, _POW_FNS) or is_method(node, _POW_METHODS)) or not node.args:
        return None
    if not isinstance(node.args[0], fx.Node):
        return None
    return arg(node, 1, "exponent")


def squared_relu(node: Any) -> Optional[tuple[fx.Node, list[fx.Node]]]:
    """If ``node`` is relu(p)^2 of a linear projection p, in any spelling (``relu(p) ** 2``,
    ``torch.pow(relu(p), 2)``, ``relu(p).pow(2)``, ``torch.square(relu(p))``, ``relu(p) *
    relu(p)`` with one ReLU or two of the same value; transformers' ACT2FN["relu2"] traces to
    the square): (the ReLU node, the nodes from ``node`` down to the ReLU(s), ReLUs included).
    Else None."""
    node = skip(node)
    if not isinstance(node, fx.Node):
        return None
    base = None
    e = _exponent(node)
    if e is not None:
        if isinstance(e, bool) or not isinstance(e, (int, float)) or e != 2:
            return None
        base = node.args[0]
    elif (is_fn(node, _SQUARE_FNS) or is_method(node, _SQUARE_METHODS)) and node.args:
        base = node.args[0]
    elif (is_fn(node, MUL_FNS) or is_method(node, MUL_METHODS)) and len(node.args) == 2 and not node.kwargs:
        a, b = (skip(v) for v in node.args)
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node) and is_relu(a) and is_relu(b)):
            return None
        if a is not b and (mutates_first_arg(a) or mutates_first_arg(b) or not a.args or not b.args
                           or skip(a.args[0]) is not skip(b.args[0])):
            return None
        if resolve_projection(a.args[0]) is None:
            return None
        nodes = [node] + chain(node.args[0], a) + [a]
        if b is not a:
            nodes += chain(node.args[1], b) + [b]
        else:
            nodes += chain(node.args[1], b)
        return a, nodes
    if not isinstance(base, fx.Node):
        return None
    r = skip(base)
    if not (isinstance(r, fx.Node) and is_relu(r) and r.args and resolve_projection(r.args[0]) is not None):
        return None
    return r, [node] + chain(base, r) + [r]


def _power_of_relu(node: Any) -> Optional[str]:
    """A plain reason when ``node`` raises relu(projection) to a power other than 2."""
    node = skip(node)
    e = _exponent(node) if isinstance(node, fx.Node) else None
    if e is None or e == 2:
        return None
    r = skip(node.args[0])
    if isinstance(r, fx.Node) and is_relu(r) and r.args and resolve_projection(r.args[0]) is not None:
        return f"the ReLU output is raised to the power {e!r}: only squared ReLU (power 2) is rewritten"
    return None


def match_gated(down_node: fx.Node, h: fx.Node, reject: Any) -> Optional[_Block | Rejection]:
    """``relu(gate(x)) * up(x)`` at the down projection's input ``h`` (a product), either order."""
    if len(h.args) != 2 or not all(isinstance(a, fx.Node) for a in h.args):
        return _transformed(down_node, h, reject)
    a, b = h.args
    # squared ReLU gate: relu(gate(x)) ** 2 * up(x)
    for g_side, u_side in ((a, b), (b, a)):
        sq = squared_relu(g_side)
        if sq is None:
            continue
        g, sq_nodes = sq
        gp, up = resolve_projection(g.args[0]), resolve_projection(u_side)
        if up is None:
            u = skip(u_side)
            what = "ReLU" if isinstance(u, fx.Node) and is_relu(u) else _describe(u)
            return reject(down_node, f"relu(gate)**2 times {what} of the up branch: squared ReLU takes the up "
                                     "projection as it is (dReLU: relu(gate) * relu(up), unsquared)")
        internal = ([h] + chain(g_side, skip(g_side)) + sq_nodes + chain(g.args[0], skip(g.args[0])) + gp.nodes
                    + chain(u_side, skip(u_side)) + up.nodes)
        return _Block(gp, up, g, internal, "relu2")
    # dReLU: relu(gate(x)) * relu(up(x))
    ga, gb = skip(a), skip(b)
    if (isinstance(ga, fx.Node) and isinstance(gb, fx.Node) and ga is not gb and is_relu(ga) and is_relu(gb)
            and ga.args and gb.args):
        gp, up = resolve_projection(ga.args[0]), resolve_projection(gb.args[0])
        if gp is not None and up is not None:
            order = {n: i for i, n in enumerate(h.graph.nodes)}
            if order[up.out] < order[gp.out]:      # the gate: the factor computed first (symmetric)
                a, b, ga, gb, gp, up = b, a, gb, ga, up, gp
            internal = ([h] + chain(a, ga) + [ga] + chain(ga.args[0], skip(ga.args[0])) + gp.nodes
                        + chain(b, gb) + [gb] + chain(gb.args[0], skip(gb.args[0])) + up.nodes)
            return _Block(gp, up, ga, internal, "drelu")
    for g_side, u_side in ((a, b), (b, a)):
        g = skip(g_side)
        if isinstance(g, fx.Node) and is_relu(g):
            gp = resolve_projection(g.args[0])
            up = resolve_projection(u_side)
            if gp is None and up is None:
                continue
            if gp is None:
                return reject(down_node, f"the ReLU's input is {_describe(skip(g.args[0]))}, not a linear projection")
            if up is None:
                why = _power_of_relu(u_side)
                return reject(down_node, why or f"the up branch is {_describe(skip(u_side))}, not a linear projection")
            internal = ([h] + chain(g_side, g) + [g] + chain(g.args[0], skip(g.args[0])) + gp.nodes
                        + chain(u_side, skip(u_side)) + up.nodes)
            return _Block(gp, up, g, internal)
    for side in (a, b):
        why = _power_of_relu(side)
        if why is not None and any(resolve_projection(o) is not None for o in (a, b) if o is not side):
            return reject(down_node, why)
    for side in (a, b):
        s = skip(side)
        act = activation_name(s) if isinstance(s, fx.Node) else None
        if act and s.args and resolve_projection(s.args[0]) is not None:
            return reject(down_node, f"gate activation is {act}, not ReLU")
    if resolve_projection(a) is not None and resolve_projection(b) is not None:
        return reject(down_node, "gated product has no activation (bilinear), not ReLU")
    for g_side, u_side in ((a, b), (b, a)):
        ops = composite_activation(g_side)
        if ops and resolve_projection(u_side) is not None:
            return reject(down_node, f"gate activation is an elementwise expression ({ops}), not ReLU")
    ops = composite_activation(h)
    if ops:
        return reject(down_node, f"activation is an elementwise expression ({ops}), not ReLU")
    return _transformed(down_node, h, reject)


def match_plain(down_node: fx.Node, h: fx.Node, reject: Any) -> Optional[_Block | Rejection]:
    """``relu(up(x))`` or its square at the down projection's input ``h``; other activations
    are rejected with their name."""
    sq = squared_relu(h)
    if sq is not None:
        r, nodes = sq
        gate = resolve_projection(r.args[0])
        return _Block(gate, None, r, nodes + chain(r.args[0], skip(r.args[0])) + gate.nodes, "relu2")
    why = _power_of_relu(h)
    if why is not None:
        return reject(down_node, why)
    if is_relu(h):
        gate = resolve_projection(h.args[0])
        if gate is None:
            return None
        return _Block(gate, None, h, [h] + chain(h.args[0], skip(h.args[0])) + gate.nodes)
    act = activation_name(h)
    if act and h.args and isinstance(h.args[0], fx.Node) and resolve_projection(h.args[0]) is not None:
        return reject(down_node, f"activation is {act}, not ReLU")
    if is_fn(h, DROPOUT_FNS) or is_method(h, {"dropout"}):
        if h.args and _relu_block(h.args[0]):
            return reject(down_node, "dropout in training mode between the projections")
        return None
    ops = composite_activation(h)
    if ops:
        return reject(down_node, f"activation is an elementwise expression ({ops}), not ReLU")
    return _transformed(down_node, h, reject)


def _zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def _row_mask(node: fx.Node, mask: Any) -> bool:
    """Whether ``mask`` is a boolean mask that takes whole rows of ``node``'s [S, N] output
    (its last dim 1 or none) and does not broadcast that output to another shape."""
    me, out, src = example(mask), example(node), example(node.args[0] if node.args else None)
    if me is None or out is None or src is None or me.dtype != torch.bool:
        return False
    return (me.dim() == 0 or str(me.shape[-1]) == "1") and me.dim() <= out.dim() and shape_key(out) == shape_key(src)


def _masked_rows_problem(down_node: fx.Node, projections: list[Optional[Projection]]) -> Optional[str]:
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
                return (f"a tensor that may alias the row mask is modified in place ({_describe(n)} on "
                        f"{target.name}) between the masked_fill calls")
    return None


def check_block(down_node: fx.Node, down: Projection, blk: _Block) -> Optional[str]:
    """Why a matched block must not be rewritten, or None. ``blk.internal`` is completed (the
    nodes the rewrite removes, deduplicated) as a side effect."""
    gate, up, relu_node = blk.gate, blk.up, blk.relu
    grouped = [p.offs for p in (gate, up, down) if p is not None]
    if any(o is not None for o in grouped):
        if any(o is None for o in grouped):
            return "mixes grouped (per-expert) and plain projections"
        if len(set(grouped)) != 1:
            return "its grouped projections take different expert offsets"
        why = _masked_rows_problem(down_node, [gate, up])
        if why is not None:
            return why
    # Same input for gate and up.
    if up is not None:
        gx, ux = gate.x, up.x
        if gx is not ux:
            ge, ue = example(gx), example(ux)
            if skip(gx) is not skip(ux) or ge is None or ue is None or shape_key(ge) != shape_key(ue):
                return "gate and up projections read different inputs"
        if (gate.rows is None) != (up.rows is None):
            return "one of gate/up is a slice of a fused projection and the other is not"
        if gate.rows is not None and gate.weight is not up.weight:
            return "gate and up are slices of different projections"
    # An in-place ReLU writes into the gate's output; if the up branch reads that storage too
    # (the same projection, or overlapping slices of one fused projection), eager multiplies
    # by the clamped values. Leave such blocks alone.
    if up is not None and mutates_first_arg(relu_node):
        same = skip(gate.out) is skip(up.out) or (gate.rows is None and up.rows is None and gate.out is up.out)
        overlap = (gate.rows is not None and up.rows is not None and gate.weight is up.weight
                   and gate.rows[0] < up.rows[1] and up.rows[0] < gate.rows[1])
        if same or overlap:
            return "in-place ReLU on the gate also changes what the up branch reads"
    # Each intermediate value must be used only inside the block.
    blk.internal = list(dict.fromkeys(blk.internal))
    leak = _has_outside_users(blk.internal, down_node)
    if leak is not None:
        return f"intermediate {leak.name} has other users"
    # The rewrite reads the input and every weight and bias once, at the down projection; eager
    # reads each where its projection runs. Any write between the block's first read and the
    # down projection into a tensor that may share storage with what the block reads (x, a
    # view or slice of it, a weight or its .data, a bias) would be seen by one and not the
    # other: leave such blocks alone. Only writes into tensors provably allocated apart from
    # those inputs (fresh results, e.g. the gate's own output under an in-place ReLU) pass.
    why = _mutation_inside(down_node, blk.internal, [gate, up, down])
    if why is not None:
        return why
    for p, what in ((gate, "gate"), (up, "up"), (down, "down")):
        why = _bias_problem(p, what)
        if why is not None:
            return why
    # Dtypes, devices, shapes.
    outs = [example(p.out) for p in (gate, up, down) if p is not None]
    xe = example(gate.x)
    if any(o is None for o in outs) or xe is None:
        return "missing shape information"
    if not all(o.is_floating_point() for o in outs):
        return f"dtype {outs[0].dtype} is not floating point"
    if len({o.dtype for o in outs}) != 1:
        return "projections produce different dtypes"
    if len({o.device for o in outs} | {xe.device}) != 1:
        return "tensors on different devices"
    if xe.dim() < 1 or (gate.rows is not None and up is not None and
                        (gate.rows[1] - gate.rows[0]) != (up.rows[1] - up.rows[0])):
        return "gate and up widths differ"
    he = example(down.x)
    if he is None or (shape_key(he)[:-1] != shape_key(xe)[:-1] and he.dim() != 2):
        return "a reshape between the projections changes the token layout"
    return None


def match_at(down_node: fx.Node, roots: Optional[dict[str, str]] = None) -> Optional[Match | Rejection]:
    """Try to read ``down_node`` as the down projection of a ReLU FFN: the gated or the plain
    matcher on its input, then the block checks."""
    down = as_projection(down_node)
    if down is None or down.out is not down_node or down.rows is not None:
        return None
    if down.bias is None and _bias_add(down_node) is not None:
        return None   # matmul followed by its bias add: the add is the down projection
    h = skip(down.x)
    if not isinstance(h, fx.Node):
        return None
    where = layer_name([down_node, h], roots)

    def reject(node: fx.Node, reason: str) -> Rejection:
        return Rejection(node, reason, where)

    product = (is_fn(h, MUL_FNS) or is_method(h, MUL_METHODS)) and squared_relu(h) is None   # relu(p) * relu(p)
    matcher = match_gated if product else match_plain
    found = matcher(down_node, h, reject)
    if not isinstance(found, _Block):
        return found
    found.internal = list(down.nodes) + chain(down.x, h) + found.internal
    name = layer_name([n.out for n in (found.gate, found.up, down) if n is not None], roots)
    why = check_block(down_node, down, found)
    if why is not None:
        return Rejection(down_node, why, name)
    return Match(down, found.gate, found.up, found.gate.x, found.internal, name, found.act)


def _fused_encoder_layer(node: fx.Node, roots: Optional[dict[str, str]] = None) -> Optional[Rejection]:
    """nn.TransformerEncoderLayer's inference fast path: the whole layer, FFN included, is one
    ATen op (taken under no_grad in eval mode); nothing in it can be replaced."""
    if not (node.op == "call_function" and node.target is getattr(torch, "_transformer_encoder_layer_fwd", None)):
        return None
    use_gelu = arg(node, 7, "use_gelu", False)
    act = "GELU" if use_gelu else "ReLU"
    return Rejection(node, f"nn.TransformerEncoderLayer fast path: the {act} FFN is fused into "
                            "torch._transformer_encoder_layer_fwd (runs when no gradient is needed); "
                            "nothing to rewrite", layer_name([node], roots))


# ------------------------------------------------------------------------------ torch.func transforms
# Dynamo inlines torch.func transforms (and forward_ad.dual_level) into the graph as calls that
# enter and leave a transform level. Inside one, the recorded values are functorch wrappers
# (BatchedTensor, GradTrackingTensor) whose requires_grad says nothing about the gradient the
# transform takes, and the twell ops have no batching rule, no forward-mode derivative, and an
# autograd formula (register_autograd) that torch.func cannot run: such FFNs stay with Inductor.
_NO_FORWARD_AD = "the twell ops have no forward-mode derivative"
_TRANSFORM_ENTER = {
    "_vmap_increment_nesting": "inside torch.func.vmap: the twell ops have no batching rule, and the traced "
                               "values do not show whether a gradient is needed",
    "_grad_increment_nesting": "inside torch.func.grad/vjp/jacrev: twell's autograd formula does not run "
                               "under torch.func transforms",
    "_jvp_increment_nesting": f"inside torch.func.jvp/jacfwd (forward-mode AD): {_NO_FORWARD_AD}",
    "_enter_dual_level": f"inside torch.autograd.forward_ad.dual_level (forward-mode AD): {_NO_FORWARD_AD}",
    "_func_increment_nesting": "inside torch.func.functionalize: left to Inductor",
}
_TRANSFORM_EXIT = {"_vmap_decrement_nesting", "_grad_decrement_nesting", "_jvp_decrement_nesting",
                   "_exit_dual_level", "_func_decrement_nesting"}
_WRAPPED = "its values are torch.func-wrapped tensors (a torch.func transform is active)"
_DUAL_INPUT = f"an input is a forward-mode dual tensor (torch.autograd.forward_ad): {_NO_FORWARD_AD}"


def _call_name(node: fx.Node) -> str:
    return str(getattr(node.target, "__name__", "")) if node.op == "call_function" else ""


def transform_regions(graph: fx.Graph) -> dict[fx.Node, str]:
    """The nodes inside a torch.func transform or dual level, each with the innermost one's
    reason for leaving FFNs there to Inductor. A graph that leaves a level it never entered
    counts as inside from its start."""
    regions: dict[fx.Node, str] = {}
    stack: list[str] = []
    before: list[fx.Node] = []
    for node in graph.nodes:
        name = _call_name(node)
        if name in _TRANSFORM_ENTER:
            jvp = _TRANSFORM_ENTER["_jvp_increment_nesting"]
            # torch.func.jvp enters a dual level of its own: name the transform, not the level
            stack.append(jvp if name == "_enter_dual_level" and stack and stack[-1] == jvp
                         else _TRANSFORM_ENTER[name])
        elif name in _TRANSFORM_EXIT:
            if stack:
                stack.pop()
            else:
                for n in before:
                    regions.setdefault(n, "inside a torch.func transform entered before this graph")
        if stack:
            regions[node] = stack[-1]
        before.append(node)
    return regions


def _wrapped(node: Any) -> bool:
    ev = example(node)
    return ev is not None and torch._C._functorch.is_functorch_wrapped_tensor(ev)


def dual_inputs(graph: fx.Graph) -> Optional[str]:
    """The reason when a graph input is a forward-mode dual tensor (compiled and called inside
    ``forward_ad.dual_level`` with ``make_dual`` inputs; Dynamo guards on the dual level)."""
    if fwAD._current_level < 0:
        return None
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        arg = node.meta.get("grapharg")
        try:
            real = getattr(arg, "example", None)
        except Exception:     # a freed weak reference
            real = None
        if isinstance(real, torch.Tensor) and not isinstance(real, torch._subclasses.FakeTensor):
            if fwAD.unpack_dual(real).tangent is not None:
                return _DUAL_INPUT
    return None


def transform_reason(graph: fx.Graph) -> Optional[str]:
    """Why no FFN anywhere in a graph's subgraphs may be rewritten: the graph runs a torch.func
    transform or dual level somewhere, or takes dual inputs. Subgraphs (higher-order ops) are
    judged by the graph holding them, conservatively as a whole."""
    regions = transform_regions(graph)
    if regions:
        return next(iter(regions.values()))
    return dual_inputs(graph)


def find_ffns(graph: fx.Graph, outer: Optional[str] = None,
              roots: Optional[dict[str, str]] = None) -> list[Match | Rejection]:
    """Every match or rejection in a graph (not its subgraphs), in graph order. ``outer``: a
    reason that holds for the whole graph (a subgraph inside a torch.func transform);
    ``roots``: the model paths of the graph's source roots (``module_roots``)."""
    found: list[Match | Rejection] = []
    claimed: set[fx.Node] = set()
    regions = transform_regions(graph)
    whole = outer or dual_inputs(graph)
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        result = _fused_encoder_layer(node, roots) or match_at(node, roots)
        if result is None:
            continue
        if isinstance(result, Match):
            if claimed & set(result.internal):
                continue
            claimed |= set(result.internal)
            why = whole or regions.get(node) or (_WRAPPED if _wrapped(node) or _wrapped(result.x) else None)
            if why is not None:
                result = Rejection(node, why, result.layer)
        found.append(result)
    return found
