"""Alias and in-place write analysis over an FX graph: which nodes write into which values
(``written``: in-place methods and functions, ``inplace=True``, ``out=``, ``setitem``, ATen
schemas that mark an argument written) and what a value may share storage with
(``alias_roots``: fresh tensors allocated in the graph, or something from outside it). The
matcher's block checks use both to leave alone blocks with a write between their first read
and their down projection into anything they read.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import fx


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
