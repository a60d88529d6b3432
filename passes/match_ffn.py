"""Finds ReLU feed-forward blocks in a Dynamo (torch-level) FX graph. Analysis only.

A match is ``down(relu(gate(x)) * up(x))`` or ``down(relu(up(x)))``, or the same with squared
ReLU (``relu(.) ** 2`` in any spelling: ``squared_relu``) in place of ReLU, or dReLU
``down(relu(gate(x)) * relu(up(x)))``; ``Match.act`` says which. Each projection is
any spelling of a linear map (``projections``: ``F.linear``, ``x @ w.t()``, ``torch.matmul``,
``addmm``, matmul plus bias add, ``torch._grouped_mm``), the gate and up may come from one
fused projection split by ``chunk``, ``split`` or slicing, and identity-like nodes (eval-mode
dropout, ``contiguous``, same-dtype casts, reshapes that keep the last dimension) may sit in
between. Grouped (MoE experts) projections may reach the activation through
``masked_fill(out, row_mask, 0)`` when the down projection's output is masked the same way
(``experts.masked_rows_problem``).

Biases may be [N] or broadcast as one value per feature ([1], 0-d, [1, N]; the rewrite
expands them). FFN-shaped blocks that are *not* rewritten come back as rejections with a plain
reason, among them blocks with an in-place write between their first read and the down
projection into anything that may share storage with the input, a weight or a bias (alias
analysis over the graph, ``alias``: only writes into fresh tensors pass), and blocks inside a
torch.func transform or forward-mode AD (``transforms``). Layer names: ``naming``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import fx

from twell_compile.passes.alias import alias_roots, mutates_first_arg, written
from twell_compile.passes.experts import grouped_problem
from twell_compile.passes.naming import layer_name
from twell_compile.passes.pass_utils import (DROPOUT_FNS, MUL_FNS, MUL_METHODS, activation_name, arg, chain,
                                             describe, example, is_fn, is_method, is_relu, shape_key, skip)
from twell_compile.passes.projections import Projection, as_projection, bias_add, per_feature, resolve_projection
from twell_compile.passes.transforms import dual_inputs, transform_regions, wrapped_reason


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
        name = describe(n)
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
            return reject(down_node, f"the ReLU output goes through {describe(h)} before the down projection")
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
                    f"({describe(n)} on {target.name}) inside the block")
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
            what = "ReLU" if isinstance(u, fx.Node) and is_relu(u) else describe(u)
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
                return reject(down_node, f"the ReLU's input is {describe(skip(g.args[0]))}, not a linear projection")
            if up is None:
                why = _power_of_relu(u_side)
                return reject(down_node, why or f"the up branch is {describe(skip(u_side))}, not a linear projection")
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


def check_block(down_node: fx.Node, down: Projection, blk: _Block) -> Optional[str]:
    """Why a matched block must not be rewritten, or None. ``blk.internal`` is completed (the
    nodes the rewrite removes, deduplicated) as a side effect."""
    gate, up, relu_node = blk.gate, blk.up, blk.relu
    why = grouped_problem(down_node, gate, up, down)
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
    if down.bias is None and bias_add(down_node) is not None:
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
            why = whole or regions.get(node) or wrapped_reason(node, result.x)
            if why is not None:
                result = Rejection(node, why, result.layer)
        found.append(result)
    return found
