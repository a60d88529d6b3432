"""Rewrites every matched ReLU FFN into one ``twell`` op, in the graph and all its subgraphs.
A squared-ReLU or dReLU match passes its activation as the op's ``act``. A match of grouped
projections (MoE experts through ``torch._grouped_mm``: transformers' default
``experts_implementation="grouped_mm"``) becomes ``twell::experts`` / ``twell::experts_train``,
taking the graph's own expert offsets: the routing before it and the weighting after it stay
Inductor's.

The op is ``twell::ffn`` where the block's output needs no gradient (grad mode off at trace
time or nothing requiring grad), else ``twell::ffn_train``, whose backward is ours. Inputs
are cast to the dtype the projections produced, so autocast regions keep their numerics;
outside autocast a projection whose operands differ in dtype is left to Inductor, which
raises as eager's F.linear does. Each op gets an ``instance`` number of its own (its runtime
state, e.g. the density measurements, is not shared with other compiles). Where the down
projection's weight is a parameter the graph takes as input (Dynamo's lifted module
parameters), the op also takes it as ``owner``: every module that runs this graph then reports
under its own module path and instance (``runtime/names.py``). Where the plan's
compile-time twin (``ops.static_reason``) says the op would surely run slower than Inductor's
code, the FFN is left to Inductor with that reason (``twell.skip_dense``).
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Union

import torch
from torch import fx

from twell_compile.config import TwellConfig
from twell_compile.ops import declare, mark_graphs, next_instance, static_path, static_reason
from twell_compile.passes.match_ffn import Match, Rejection, find_ffns
from twell_compile.passes.naming import module_path, module_roots, source_root
from twell_compile.passes.pass_utils import example, graph_modules, report_of, tokens_str
from twell_compile.passes.projections import Projection
from twell_compile.passes.transforms import transform_reason
from twell_compile.report import ROOT_LAYER, RejectionEntry, RewriteEntry


def _cast(graph: fx.Graph, node: Optional[fx.Node], dtype: torch.dtype) -> Optional[fx.Node]:
    if node is None:
        return None
    ev = example(node)
    if ev is not None and ev.dtype == dtype:
        return node
    return graph.call_method("to", (node, dtype))


def _bias(graph: fx.Graph, p: Projection, dtype: torch.dtype) -> Optional[fx.Node]:
    """p's bias cast to ``dtype`` as one value per output feature of the whole projection: a
    broadcast bias ([1], 0-d, [1, N]; legal for F.linear and addmm) is reshaped and expanded to
    [N] (contiguous: the kernels take a plain vector). Autograd sums its gradient back."""
    b = _cast(graph, p.bias, dtype)
    if b is None:
        return None
    be, width = example(p.bias), p.width
    if be.dim() != 1:
        b = graph.call_method("reshape", (b, -1))
    if str(be.numel()) != str(width):
        b = graph.call_method("contiguous", (graph.call_method("expand", (b, width)),))
    return b


def _weight(graph: fx.Graph, p: Projection, dtype: torch.dtype) -> tuple[fx.Node, Optional[fx.Node]]:
    """p's weight as an [N, K] view and its bias as [N], both cast to ``dtype``."""
    w = p.weight
    if p.transposed:
        w = graph.call_function(torch.t, (w,))
    b = _bias(graph, p, dtype)
    if p.rows is not None:
        rows = slice(*p.rows)
        w = graph.call_function(operator.getitem, (w, rows))
        if b is not None:
            b = graph.call_function(operator.getitem, (b, rows))
    return _cast(graph, w, dtype), b


def _expert_weight(graph: fx.Graph, p: Projection, dtype: torch.dtype) -> fx.Node:
    """A grouped projection's weight as [E, N, K] (its rows of each expert's map), in ``dtype``."""
    w = p.weight
    if p.transposed:
        w = graph.call_method("transpose", (w, -2, -1))
    if p.rows is not None:
        w = graph.call_function(operator.getitem, (w, (slice(None), slice(*p.rows))))
    return _cast(graph, w, dtype)


def _experts_call(graph: fx.Graph, m: Match, config: TwellConfig, layer: str, dtype: torch.dtype,
                  training: bool, instance: int, act: dict[str, Any]) -> tuple[torch._ops.OpOverload, fx.Node]:
    """The twell::experts(_train) call replacing a grouped (MoE experts) match; its output y."""
    x = _cast(graph, m.x, dtype)
    wg = _expert_weight(graph, m.gate, dtype)
    wu = _expert_weight(graph, m.up, dtype) if m.up is not None else None
    wd = _expert_weight(graph, m.down, dtype)
    if training:
        op = torch.ops.twell.experts_train.default
        call = graph.call_function(op, (x, wg, wu, wd, m.down.offs, config.ell_width, config.backup_rows, 0.0, layer,
                                        config.stats, instance, config.path_for(True)), act)
        return op, graph.call_function(operator.getitem, (call, 0))
    op = torch.ops.twell.experts.default
    return op, graph.call_function(op, (x, wg, wu, wd, m.down.offs, layer, config.stats, instance,
                                        config.path_for(False)), act)


def owner_of(m: Match, layer: str, roots: dict[str, str]) -> Optional[tuple[fx.Node, str]]:
    """The down projection's weight as the Dynamo graph receives it (a lifted module
    parameter), by which each call names its own module (runtime/names.py), and that weight's
    path below ``layer``; None where the weight is not a parameter input of the graph (an fx or
    export graph holds it as an attribute: one module per graph) or its path is not below
    ``layer``."""
    w = m.down.weight
    grapharg = w.meta.get("grapharg") if w.op == "placeholder" else None
    source = getattr(getattr(grapharg, "source", None), "name", None)
    if not isinstance(source, str) or "_parameters[" not in source or not source_root(source):
        return None
    path = ".".join(p for p in (roots.get(source_root(source), ""), module_path(source)) if p)
    if layer == ROOT_LAYER:         # the compiled frame's own forward holds the FFN
        return w, path
    if not path.startswith(layer + "."):
        return None
    return w, path[len(layer) + 1:]


def _rewrite(graph: fx.Graph, m: Match, config: TwellConfig, layer: str,
             owner: Optional[tuple[fx.Node, str]]) -> tuple[str, fx.Node]:
    down_node = m.down.out
    out = example(down_node)
    dtype = out.dtype
    training = out.requires_grad
    instance = next_instance()
    kwargs: dict[str, Any] = {"act": m.act} if m.act != "relu" else {}     # (ReLU graphs keep the default)
    if owner is not None:
        kwargs["owner"] = owner[0]
        declare(instance, layer, owner[1])
    if config.in_cudagraphs and not training:
        # the bounds static_reason applied (cudagraphs) hold for the op's calls too
        mark_graphs(instance)
    with graph.inserting_before(down_node):
        if m.down.offs is not None:
            op, y = _experts_call(graph, m, config, layer, dtype, training, instance, kwargs)
        else:
            op, y = _ffn_call(graph, m, config, layer, dtype, training, instance, kwargs)
        if example(m.x).dim() != example(m.down.x).dim():
            y = graph.call_method("reshape", (y, -1, out.shape[-1]))
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in down_node.meta:
            y.meta[key] = down_node.meta[key]
    y.meta["example_value"] = out
    down_node.replace_all_uses_with(y)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(m.internal, key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
    return str(op.name()), y


def _ffn_call(graph: fx.Graph, m: Match, config: TwellConfig, layer: str, dtype: torch.dtype,
              training: bool, instance: int, act: dict[str, Any]) -> tuple[torch._ops.OpOverload, fx.Node]:
    """The twell::ffn(_train) call replacing a match; its output y."""
    x = _cast(graph, m.x, dtype)
    wg, bg = _weight(graph, m.gate, dtype)
    wu, bu = _weight(graph, m.up, dtype) if m.up is not None else (None, None)
    wd, bd = _weight(graph, m.down, dtype)
    if training:
        op = torch.ops.twell.ffn_train.default
        # l1_scale (0.0 here) is filled in by the scale_l1 pass once all FFNs are known.
        call = graph.call_function(op, (x, wg, bg, wu, bu, wd, bd, config.ell_width, config.backup_rows,
                                        0.0, layer, config.stats, instance, config.path_for(True)), act)
        return op, graph.call_function(operator.getitem, (call, 0))
    op = torch.ops.twell.ffn.default
    return op, graph.call_function(op, (x, wg, bg, wu, bu, wd, bd, layer, config.stats, instance,
                                        config.path_for(False)), act)


def _remap(m: Match, replaced: dict[fx.Node, fx.Node]) -> None:
    """Point the match's inputs at the replacements of nodes earlier rewrites removed."""
    m.x = replaced.get(m.x, m.x)
    for p in (m.gate, m.up, m.down):
        if p is None:
            continue
        p.x = replaced.get(p.x, p.x)
        p.weight = replaced.get(p.weight, p.weight)
        if p.bias is not None:
            p.bias = replaced.get(p.bias, p.bias)


_ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast
_EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast
Scope = tuple[tuple[str, bool], ...]     # autocast regions in force: (device type, enabled), innermost last


def autocast_scopes(gm: fx.GraphModule) -> dict[fx.Node, Scope]:
    """The autocast regions Dynamo recorded (``_enter_autocast`` / ``_exit_autocast`` nodes)
    around each node of the graph and its subgraphs; a subgraph starts from where its parent
    refers to it. Outside every region, the state the compile ran under holds."""
    out: dict[fx.Node, Scope] = {}
    starts: dict[str, Scope] = {}
    for name, sub in graph_modules(gm):
        scope = starts.get(name, ())
        stack: list[Scope] = []
        for node in sub.graph.nodes:
            if node.op == "call_function" and node.target is _ENTER_AUTOCAST:
                args = list(node.args) + [None] * 3
                dev = args[0] if args[0] is not None else node.kwargs.get("device_type")
                on = args[2] if len(node.args) > 2 else node.kwargs.get("enabled", True)
                stack.append(scope)
                scope = scope + ((str(dev), bool(on)),)
            elif node.op == "call_function" and node.target is _EXIT_AUTOCAST and stack:
                scope = stack.pop()
            out[node] = scope
            if node.op == "get_attr":
                starts.setdefault(f"{name}.{node.target}" if name else str(node.target), scope)
    return out


def autocast_on(scope: Scope, device_type: str) -> bool:
    for dev, on in reversed(scope):
        if dev == device_type:
            return on
    return torch.is_autocast_enabled(device_type)


def mixed_dtypes(m: Match, scopes: dict[fx.Node, Scope]) -> Optional[str]:
    """Why eager would refuse the block: a projection whose input, weight and bias differ in
    dtype outside autocast (F.linear raises; Dynamo's fake tensors do not); else None."""
    for what, p in (("gate", m.gate), ("up", m.up), ("down", m.down)):
        if p is None:
            continue
        vals = {name: example(node) for name, node in (("input", p.x), ("weight", p.weight), ("bias", p.bias))}
        dtypes = {name: v.dtype for name, v in vals.items() if v is not None}
        if len(set(dtypes.values())) < 2 or vals["input"] is None:
            continue
        if not autocast_on(scopes.get(p.out, ()), vals["input"].device.type):
            desc = ", ".join(f"{name} {str(dt).replace('torch.', '')}" for name, dt in dtypes.items())
            return (f"its {what} projection mixes dtypes ({desc}) outside autocast, which F.linear "
                    "refuses: left to Inductor, which raises as eager does")
    return None


def _unique(name: str, used: set[str]) -> str:
    out, i = name, 1
    while out in used:
        i += 1
        out = f"{name}#{i}"
    used.add(out)
    return out


def _tokens_count(shape: Any) -> Union[int, torch.SymInt]:
    """The token count: the product of the leading dims, an int when every one is static."""
    m = 1
    for d in shape[:-1]:
        m = m * d
    return m


def fuse_ffn(gm: fx.GraphModule, config: TwellConfig) -> fx.GraphModule:
    """Replace every ReLU FFN with a twell op; record rewrites and rejections."""
    report = report_of(gm)
    used = {r.layer for r in report.rewrites}
    scopes = autocast_scopes(gm)
    # Subgraphs (higher-order ops) of a graph running a torch.func transform, or taking
    # forward-mode dual inputs, are left alone as a whole (transforms.transform_reason).
    outer = transform_reason(gm.graph)
    roots = module_roots(gm)            # layer names as the whole model's frame gives them
    for sub_name, sub in graph_modules(gm):
        changed = False
        replaced: dict[fx.Node, fx.Node] = {}   # down projection -> the op output replacing it
        for found in find_ffns(sub.graph, outer if sub is not gm else None, roots):
            if isinstance(found, Match):
                # One FFN may feed the next directly (x = previous down projection): that node
                # is gone once the previous FFN is rewritten.
                _remap(found, replaced)
            if isinstance(found, Rejection):
                report.add_rejection(RejectionEntry(found.layer, found.reason, sub_name))
                continue
            why = mixed_dtypes(found, scopes)
            if why is not None:
                report.add_rejection(RejectionEntry(found.layer, why, sub_name))
                continue
            out = example(found.down.out)
            if not config.enabled:
                report.add_rejection(RejectionEntry(found.layer, "twell.enabled is False", sub_name))
                continue
            if out.requires_grad and not config.rewrite_training:
                report.add_rejection(RejectionEntry(found.layer, "needs a gradient and twell.rewrite_training is False", sub_name))
                continue
            if not out.requires_grad and not config.rewrite_inference:
                report.add_rejection(RejectionEntry(found.layer, "inference and twell.rewrite_inference is False", sub_name))
                continue
            xe = example(found.x)
            n = found.gate.rows[1] - found.gate.rows[0] if found.gate.rows else int(example(found.down.x).shape[-1])
            experts = int(example(found.down.weight).shape[0]) if found.down.offs is not None else 0
            # an expert's FFN runs on its share of the rows (equal shares assumed at compile time)
            tokens = _tokens_count(xe.shape) // experts if experts else _tokens_count(xe.shape)
            if config.skip_dense:
                # a dynamic count (SymInt) may be answered under a guard (runtime/select.py)
                why = static_reason(out.device, out.dtype, tokens, int(xe.shape[-1]), n,
                                    int(out.shape[-1]), gated=found.gated, training=out.requires_grad,
                                    l1=config.l1 or float(config.target_for(found.layer) is not None),
                                    cudagraphs=config.in_cudagraphs,
                                    path=config.path_for(out.requires_grad), experts=experts)
                if why is not None:
                    report.add_rejection(RejectionEntry(found.layer, f"{why}; Inductor's dense FFN is faster "
                                                        "(twell.skip_dense=False rewrites it anyway)", sub_name))
                    continue
            layer = _unique(found.layer, used)
            down_node = found.down.out
            op_name, y = _rewrite(sub.graph, found, config, layer,
                                  owner_of(found, layer, roots) if layer == found.layer else None)
            replaced[down_node] = y
            changed = True
            runs = static_path(out.device, out.dtype, tokens, int(xe.shape[-1]), n,
                               int(out.shape[-1]), training=out.requires_grad,
                               path=config.path_for(out.requires_grad))
            report.add_rewrite(RewriteEntry(layer, found.gated, op_name, tokens_str(xe.shape), int(xe.shape[-1]),
                                            n, int(out.shape[-1]), str(out.dtype).replace("torch.", ""), sub_name,
                                            runs=runs, act=found.act, experts=experts))
        if changed:
            sub.graph.lint()
            sub.recompile()
    return gm
