"""``twell_compile.prepare(model)``: turn each ReLU FFN module into one call of a twell op.

Why: under DDP, Dynamo's DDPOptimizer (``torch._dynamo.config.optimize_ddp``, on by default)
splits the captured graph at gradient-bucket boundaries *before* any backend sees it
(torch 2.11-2.13: ``ConvertFrame`` swaps in ``DDPOptimizer.compile_fn``, which calls the
backend once per piece, with no hook in between). An FFN whose gate/up and down projections
fall in different buckets reaches the backend in two graphs and cannot be matched. A prepared
FFN is one op node taking all its weights, so the split cannot cut it (it only splits between
nodes). FSDP2 ``fully_shard`` per block works with or without ``prepare``.

How: every module whose parameters are two or three matrices (plus biases) is traced with
torch.fx (no Dynamo, no global state), shapes are propagated on the meta device, and the
backend's own matcher (``passes/match_ffn.py``) must find exactly one ReLU FFN that is the
module's whole forward. Such a module gets a subclass whose forward calls ``twell::ffn`` (no
gradient needed) or ``twell::ffn_train`` (our backward) with the module's current parameters;
its state_dict, parameters and ``isinstance`` checks are unchanged. Eager runs use the same
ops (exact), and the twell backend reports these nodes as "prepared" rewrites.

What the decision rests on is watched: while the forward is traced, every plain attribute it
reads of the module or its submodules (``self.gated``, ``nn.ReLU``'s ``inplace``, which module
``self.act`` is) is recorded, and each call compares them first. When one has changed, the
call re-decides from the module as it is now (one fx trace) and, under torch.compile, runs
the original forward (Dynamo guards on the same reads; the backend then matches that graph
itself). Values are compared by ``==`` (bool, int, float, str, None, dtypes, enums and tuples
of them), submodules by their class's forward (their own reads are watched too), anything else
by identity (a config object's fields are not looked into). Weights are read at each call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import Tensor, fx, nn

from twell_compile import control, moe
from twell_compile.config import PREFIX, TwellConfig, did_you_mean, path_for
from twell_compile.ops import experts_reason, static_reason, tag
from twell_compile.passes.match_ffn import Match, find_ffns
from twell_compile.passes.pass_utils import CAST_METHODS, DROPOUT_FNS, arg, chain, example, skip
from twell_compile.reference import activate
from twell_compile.report import ROOT_LAYER, RejectionEntry, Report, RewriteEntry

log = logging.getLogger("twell_compile")

_SPEC = "_twell_ffn"                     # instance attribute holding a prepared module's FFNSpec
# Instance attribute holding its ops.tag (a plain tensor attribute, not a buffer: state_dict,
# .to() and FSDP2 leave it alone, and Dynamo takes it as a graph input, not a constant).
_TAG = "_twell_tag"
# Instance attributes of the decision in force: the reads it rests on (Read tuples), and why the
# original forward runs instead of the op (None while the op runs).
_READS = "_twell_reads"
_FALLBACK = "_twell_fallback"
_CLASSES: dict[type, type] = {}          # original class -> its prepared subclass (shared code)


@dataclass(frozen=True)
class ProjSpec:
    """One projection: parameter paths relative to the FFN module, in nn.Linear layout after
    ``.t()`` when ``transposed``, then rows ``rows`` (one half of a fused gate+up weight)."""

    weight: str
    bias: Optional[str]
    transposed: bool
    rows: Optional[tuple[int, int]]


@dataclass(frozen=True)
class FFNSpec:
    layer: str
    gate: ProjSpec
    up: Optional[ProjSpec]
    down: ProjSpec
    ell_width: int
    backup_rows: int
    l1_scale: float
    stats: bool
    skip_dense: bool
    path: str = "auto"                    # twell.path
    instance: int = 0                     # the op instance (ops.next_instance): its runtime state
    arg: str = "x"                        # the name of forward's one input (keyword calls)
    act: str = "relu"                     # the activation (the ops' act: relu, relu2, drelu)
    l1_control: bool = False              # twell.target_density names it: its coefficient is control.py's


# ------------------------------------------------------------------------------ tracing
class _Tracer(fx.Tracer):
    """Traces through every submodule (nn.Linear becomes F.linear, nn.ReLU becomes F.relu),
    giving the same torch-level spellings as a Dynamo graph."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return False


class _MetaRun(fx.Interpreter):
    """Runs the traced graph on meta tensors and records each value as the node's example."""

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        return torch.empty_like(value, device="meta") if isinstance(value, Tensor) else value

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        n.meta["example_value"] = n.meta["val"] = out
        return out


_TRACE_ERRORS = (fx.proxy.TraceError, TypeError, RuntimeError, AttributeError, NotImplementedError,
                 ValueError, IndexError)

# A read the decision rests on: (submodule path relative to the prepared module, attribute,
# how it is compared: "eq" / "forward" / "is", the value at trace time; for "forward", a
# submodule's, the forward function of its class: torch.func.functional_call swaps a module's
# class for a subclass of its own while it runs, so the class itself is not compared).
Read = tuple[str, str, str, Any]
_MODULE_STATE = (frozenset(vars(nn.Module())) | frozenset(dir(nn.Module))) - {"training"}   # nn.Module's own
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device, enum.Enum)


def _plain(value: Any) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(map(_plain, value)))


def _how(owner: nn.Module, name: str, value: Any) -> Optional[str]:
    """How a read of ``owner.name`` is watched, or None when it is not: tensors (read at each
    call), nn.Module's bookkeeping, the class's own methods and descriptors (fixed code)."""
    if name.startswith("__") or name in _MODULE_STATE or isinstance(value, (Tensor, fx.Proxy)):
        return None
    if name not in owner.__dict__ and hasattr(getattr(type(owner), name, None), "__get__"):
        return None                       # a method or property of the class (its reads are watched)
    if isinstance(value, nn.Module):
        return "forward"
    return "eq" if _plain(value) else "is"


@contextlib.contextmanager
def _recording(module: nn.Module) -> Iterator[dict[tuple[str, str], Read]]:
    """Record the attribute reads of ``module`` and its submodules while inside: each module's
    class is swapped for a subclass whose attribute lookups log (restored on exit)."""
    reads: dict[tuple[str, str], Read] = {}
    paths = {id(m): path for path, m in module.named_modules(remove_duplicate=False)}

    def note(owner: nn.Module, name: str, value: Any) -> None:
        how = _how(owner, name, value)
        path = paths.get(id(owner))
        if how is not None and path is not None:
            reads.setdefault((path, name), (path, name, how, type(value).forward if how == "forward" else value))

    def recording_class(cls: type) -> type:
        def getattribute(self, name):
            value = super(sub, self).__getattribute__(name)
            note(self, name, value)
            return value

        def getattr_(self, name):                 # submodules, parameters and buffers
            value = cls.__getattr__(self, name)
            note(self, name, value)
            return value

        sub = type(cls.__name__, (cls,), {"__getattribute__": getattribute, "__getattr__": getattr_,
                                          "__module__": cls.__module__})
        return sub

    swapped = [(m, type(m)) for m in dict.fromkeys(module.modules())]
    try:
        for m, cls in swapped:
            m.__class__ = recording_class(cls)
        yield reads
    finally:
        for m, cls in swapped:
            m.__class__ = cls


def _trace(module: nn.Module) -> tuple[Optional[fx.GraphModule], tuple[Read, ...], str]:
    """The module's forward as a torch-level graph with meta example values and the reads it
    rests on, or a reason."""
    try:
        with _recording(module) as reads:
            graph = _Tracer().trace(module)
    except _TRACE_ERRORS as e:
        return None, (), f"torch.fx cannot trace its forward ({type(e).__name__}: {str(e)[:80]})"
    gm = fx.GraphModule(module, graph)
    if sum(n.op == "placeholder" for n in graph.nodes) != 1:
        return None, (), "forward takes more than one input"
    mats = [p for p in module.parameters() if p.dim() == 2]
    for k in dict.fromkeys([p.shape[1] for p in mats] + [p.shape[0] for p in mats]):
        x = torch.empty(2, 3, k, device="meta", dtype=mats[0].dtype)
        try:
            _MetaRun(gm).run(x)
        except _TRACE_ERRORS:
            continue
        _fold_sizes(gm)
        return gm, tuple(reads.values()), ""
    return None, (), "no input width fits its weights"


def _fold_sizes(gm: fx.GraphModule) -> None:
    """Replace size arithmetic (``x.size()[:-1] + (nf,)`` in GPT-2's Conv1D) by its meta value,
    as Dynamo's static shapes do: otherwise ``size`` counts as another user of the activation."""
    for n in list(gm.graph.nodes):
        v = n.meta.get("val")
        if n.op in ("call_function", "call_method") and (
                isinstance(v, (int, torch.Size)) or (isinstance(v, tuple) and all(type(d) is int for d in v))):
            for user in list(n.users):
                user.replace_input_with(n, tuple(v) if isinstance(v, torch.Size) else v)
    gm.graph.eliminate_dead_code()


# ------------------------------------------------------------------------------ matching
def _param_path(module: nn.Module, node: Any, what: str) -> tuple[Optional[str], str]:
    if node is None:
        return None, ""
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return None, f"the {what} is computed in forward, not a parameter"
    try:
        module.get_parameter(node.target)
    except AttributeError:
        return None, f"the {what} {node.target} is not a parameter"
    return str(node.target), ""


def _projections(module: nn.Module, gm: fx.GraphModule) -> tuple[Optional[tuple], str]:
    """(gate, up, down) ProjSpecs and the activation when the traced forward is exactly one
    ReLU-family FFN, else a reason ("" when it holds no FFN-like block at all)."""
    found = find_ffns(gm.graph)
    if not found:
        return None, ""
    if len(found) > 1:
        return None, f"forward holds {len(found)} FFN-like blocks, not exactly one"
    m = found[0]
    if not isinstance(m, Match):
        return None, m.reason
    graph = gm.graph
    x_in = next(n for n in graph.nodes if n.op == "placeholder")
    out_node = next(n for n in graph.nodes if n.op == "output")
    result = out_node.args[0]
    if not isinstance(result, fx.Node) or skip(result) is not m.down.out:
        return None, "forward returns something other than the FFN's output"
    allowed = set(m.internal) | set(chain(result, m.down.out))
    for p in (m.gate, m.up):
        if p is not None and skip(p.x) is x_in:
            allowed |= set(chain(p.x, x_in))
    for n in graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        if n not in allowed:
            return None, f"forward does more than the FFN ({n.op} {getattr(n.target, '__name__', n.target)})"
        if n.op == "call_method" and n.target in CAST_METHODS:
            return None, "forward casts dtypes inside the block (left to the backend, which sees real dtypes)"
        if n.op == "call_function" and n.target in DROPOUT_FNS and arg(n, 1, "p", 0.5) != 0:
            return None, "dropout inside the block (its training flag would be frozen)"
    if skip(m.x) is not x_in:
        return None, "the FFN input is not the forward's input"
    projs = []
    for p, what in ((m.gate, "gate"), (m.up, "up"), (m.down, "down")):
        if p is None:
            projs.append(None)
            continue
        w, why = _param_path(module, p.weight, f"{what} weight")
        if w is None:
            return None, why
        b, why = _param_path(module, p.bias, f"{what} bias")
        if why:
            return None, why
        projs.append(ProjSpec(w, b, p.transposed, p.rows))
    xe, ye = example(x_in), example(result)
    if tuple(ye.shape) != (*xe.shape[:-1], ye.shape[-1]):
        return None, "the output's leading shape differs from the input's"
    if len({p.dtype for p in module.parameters()}) != 1:
        return None, "parameters of different dtypes"
    return (*projs, m.act), ""


def _input_name(module: nn.Module) -> str:
    """The name of forward's one parameter (after self), for keyword calls."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return ""
    return params[0].name if params and params[0].kind in (params[0].POSITIONAL_OR_KEYWORD,
                                                          params[0].KEYWORD_ONLY) else ""


def _candidate(module: nn.Module) -> bool:
    params = list(module.parameters())
    return (2 <= sum(p.dim() == 2 for p in params) <= 3 and all(p.dim() in (1, 2) for p in params)
            and all(p.is_floating_point() for p in params))


# ------------------------------------------------------------------------------ running
def _get(module: nn.Module, path: str) -> Tensor:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _weights(module: nn.Module, p: ProjSpec) -> tuple[Tensor, Optional[Tensor]]:
    w = _get(module, p.weight)
    b = _get(module, p.bias) if p.bias is not None else None
    if p.transposed:
        w = w.t()
    if b is not None and tuple(b.shape) != (w.shape[0],):
        # a broadcast bias ([1]; legal for F.linear): one value per feature, as the op takes it
        b = b.reshape(-1).expand(w.shape[0]).contiguous()
    if p.rows is not None:
        w = w[p.rows[0]:p.rows[1]]
        b = b[p.rows[0]:p.rows[1]] if b is not None else None
    return w, b


@torch.compiler.assume_constant_result
def _autocast_available(dev: str) -> bool:
    """Whether ``dev`` has autocast ("meta" has none). A constant to Dynamo: torch 2.11 graph-
    broke on the query in every prepared FFN."""
    return torch.amp.is_autocast_available(dev)


@torch.compiler.assume_constant_result
def _dense_reason(device: torch.device, dtype: torch.dtype, k: int, n: int, k_out: int, gated: bool,
                  path: str) -> Optional[str]:
    """select.static_reason for any token count, a constant to Dynamo (it reads the device's
    record, whose first lookup asks the driver for the GPU's name: a graph break per prepared
    FFN under torch 2.11, 16 in a 16-layer Llama)."""
    return static_reason(device, dtype, None, k, n, k_out, gated=gated, path=path)


def run_ffn(module: nn.Module, spec: FFNSpec, x: Tensor) -> Tensor:
    """The prepared forward: one twell op with the module's current parameters."""
    wg, bg = _weights(module, spec.gate)
    wu, bu = _weights(module, spec.up) if spec.up is not None else (None, None)
    wd, bd = _weights(module, spec.down)
    tensors = [t for t in (x, wg, bg, wu, bu, wd, bd) if t is not None]
    if _is_dtensor(wg) or _is_dtensor(wd):
        raise ValueError(f"{spec.layer}: its weights are sharded DTensors when it runs; shard "
                         "the FFN module or its transformer block with fully_shard, not each Linear")
    dev = x.device.type
    # As F.linear does: inside autocast every projection runs in the autocast dtype; outside
    # it, operands of different dtypes are refused.
    autocast = _autocast_available(dev) and torch.is_autocast_enabled(dev)
    if not autocast and wg.dtype != x.dtype:
        raise RuntimeError(f"{spec.layer}: input is {x.dtype} but the weights are {wg.dtype}, "
                           "which F.linear refuses outside autocast: cast the input or the module to one "
                           "dtype, or run under torch.autocast")
    dtype = torch.get_autocast_dtype(dev) if autocast else x.dtype
    x, wg, bg, wu, bu, wd, bd = (t.to(dtype) if t is not None and t.dtype != dtype else t
                                 for t in (x, wg, bg, wu, bu, wd, bd))
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        # The layer and instance travel in the tag, read at run time: as constants they put a
        # guard on every block's frame (FSDP2, regional compilation: one compile per block).
        return torch.ops.twell.ffn_train.default(x, wg, bg, wu, bu, wd, bd, spec.ell_width, spec.backup_rows,
                                                 spec.l1_scale, "", spec.stats, 0, path_for(spec.path, True),
                                                 getattr(module, _TAG), l1_control=spec.l1_control,
                                                 **_act(spec))[0]
    if spec.skip_dense and _dense_reason(x.device, dtype, wg.shape[1], wg.shape[0], wd.shape[0],
                                         wu is not None, path_for(spec.path, False)) is not None:
        # Our op would run slower than dense here (e.g. fp32 on CUDA): the plain formula, which
        # the backend then leaves to Inductor as it does for unprepared FFNs (twell.skip_dense).
        # (The token count is not asked: it would put a guard on every prepared FFN's input.)
        h = activate(F.relu(F.linear(x, wg, bg)), None if wu is None else F.linear(x, wu, bu), spec.act)
        return F.linear(h, wd, bd)
    return torch.ops.twell.ffn.default(x, wg, bg, wu, bu, wd, bd, spec.layer, spec.stats, spec.instance,
                                       path_for(spec.path, False), **_act(spec))


def _act(spec: FFNSpec) -> dict[str, str]:
    """The op's ``act`` keyword (ReLU calls keep the schema's default, as the backend's do)."""
    return {"act": spec.act} if spec.act != "relu" else {}


def _is_dtensor(t: Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _dual(t: Optional[Tensor]) -> bool:
    return t is not None and fwAD.unpack_dual(t).tangent is not None


@torch.compiler.assume_constant_result
def _transform_depth() -> int:
    """torch.func's interpreter stack depth. Under torch.compile the value at trace time, as a
    constant: torch 2.13's Dynamo folds the call itself, 2.11's graph-broke on it in every
    prepared FFN (docs/design-notes/host.md); peek_interpreter_stack() would read as not
    None."""
    return torch._C._functorch.get_dynamic_layer_stack_depth()


def transform_active(module: nn.Module, spec: FFNSpec, x: Tensor) -> Optional[str]:
    """Why the twell ops cannot run this call, or None: a torch.func transform (vmap, grad,
    jvp, ...) is active, whose wrapped tensors the ops' autograd formula and kernels do not
    support, or forward-mode AD has a dual tensor among the FFN's inputs (the ops have no
    forward-mode derivative)."""
    if _transform_depth() > 0:
        return "a torch.func transform is active"
    if fwAD._current_level >= 0:
        params = [t for p in (spec.gate, spec.up, spec.down) if p is not None
                  for t in (_get(module, p.weight), _get(module, p.bias) if p.bias else None)]
        if any(_dual(t) for t in [x, *params]):
            return "forward-mode AD (a dual tensor among its inputs)"
    return None


_FELL_BACK: set[str] = set()       # reasons already logged


def reset_fallback_log() -> None:
    """Log each reason a prepared module runs its original forward once more."""
    _FELL_BACK.clear()


_MISSING = object()


def _now(module: nn.Module, path: str, name: str) -> Any:
    owner: Any = module
    for part in path.split(".") if path else ():
        owner = getattr(owner, part, None)
    return getattr(owner, name, _MISSING)


def changed_read(module: nn.Module, reads: tuple[Read, ...]) -> Optional[str]:
    """The first read of ``reads`` whose value differs now, in words; None when none does."""
    for path, name, how, value in reads:
        now = _now(module, path, name)
        if how == "forward":
            same = getattr(type(now), "forward", None) is value
        elif how == "eq":
            same = type(now) is type(value) and now == value
        else:
            same = now is value
        if not same:
            return f"{path + '.' if path else ''}{name} changed since it was prepared"
    return None


def _redecide(module: nn.Module, changed: str) -> None:
    """Decide again from the module as it is now (eager calls): the op with the projections its
    forward now has, or its original forward with the reason."""
    spec, prepared = getattr(module, _SPEC), type(module)
    module.__class__ = _ORIGINALS[prepared]          # trace the original forward
    try:
        gm, reads, why = _trace(module)
        projs = None
        if gm is not None:
            projs, why = _projections(module, gm)
    finally:
        module.__class__ = prepared
    if gm is None:
        # Not traced: watch the same reads at their values now, so a change back decides again
        # (and an unchanged module is not traced at every call).
        old = getattr(module, _READS)
        reads = tuple((path, name, how, type(now).forward if how == "forward" else now)
                      for path, name, how, _ in old for now in [_now(module, path, name)])
    setattr(module, _READS, reads)
    if projs is not None:
        setattr(module, _SPEC, dataclasses.replace(spec, gate=projs[0], up=projs[1], down=projs[2], act=projs[3]))
        setattr(module, _FALLBACK, None)
        log.info("twell prepare: %s: %s; decided again: it is still one ReLU FFN", spec.layer, changed)
        return
    why = f"{changed}, and its forward is no longer one ReLU FFN ({why or 'no FFN-like block'})"
    setattr(module, _FALLBACK, why)
    log.warning("twell prepare: %s: %s: it runs its original forward (plain PyTorch; under torch.compile "
                "the backend decides for its graph)", spec.layer, why)


def _the_input(spec: FFNSpec, args: tuple, kwargs: dict) -> Any:
    """The one input of a call bound as the traced forward takes it, else None."""
    if len(args) == 1 and not kwargs:
        return args[0]
    if not args and len(kwargs) == 1:
        return kwargs.get(spec.arg)
    return None


def _prepared_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    original = _ORIGINALS[type(self)].forward
    spec = getattr(self, _SPEC)
    x = _the_input(spec, args, kwargs)
    if not isinstance(x, Tensor):
        return original(self, *args, **kwargs)      # (a call that does not bind raises as unprepared)
    why = transform_active(self, spec, x)
    if why is None:
        changed = changed_read(self, getattr(self, _READS))
        if changed is not None:
            if torch.compiler.is_compiling():
                # Dynamo guards on the same reads: this graph holds the original forward, which
                # the backend matches itself.
                return original(self, *args, **kwargs)
            _redecide(self, changed)
            spec = getattr(self, _SPEC)
        if getattr(self, _FALLBACK) is not None:
            return original(self, *args, **kwargs)
        return run_ffn(self, spec, x)
    # Under a transform the module's own forward runs, as if never prepared (exact).
    if not torch.compiler.is_compiling():
        interpreter = torch._C._functorch.peek_interpreter_stack()
        if interpreter is not None:
            why = f"torch.func transform ({interpreter.key().name.lower()}) active"
        if why not in _FELL_BACK:
            _FELL_BACK.add(why)
            log.warning("twell prepare: %s: prepared FFNs run their original forward (plain PyTorch) "
                        "meanwhile; the twell ops support neither torch.func transforms nor forward-mode AD", why)
    return original(self, *args, **kwargs)


_ORIGINALS: dict[type, type] = {}        # prepared subclass -> original class


def _retag(module: nn.Module) -> None:
    """A fresh tag (and op instance) for a prepared module's layer: its own runtime state."""
    spec = getattr(module, _SPEC)
    number = tag(spec.layer)
    setattr(module, _SPEC, dataclasses.replace(spec, instance=int(number)))
    setattr(module, _TAG, number)


def _rebuild(original: type, state: dict) -> nn.Module:
    """Unpickling a prepared module: its original class (importable wherever the model's code
    is), made prepared again, with the pickled state and a tag of this process."""
    module = original.__new__(original)
    module.__class__ = _prepared_class(original)
    module.__setstate__(state)              # the original class's, if it has its own
    _retag(module)
    return module


def _prepared_reduce_ex(self: nn.Module, protocol: int) -> tuple:
    # The prepared subclass is made at run time and cannot be found by name; tags are numbers
    # of one process. So torch.save / pickle / deepcopy rebuild from the original class, and
    # the copy gets a tag (runtime state) of its own.
    return _rebuild, (_ORIGINALS[type(self)], self.__getstate__())


def _prepared_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Twell{cls.__name__}", (cls,), {"forward": _prepared_forward, "__module__": __name__,
                                                               "__reduce_ex__": _prepared_reduce_ex})
        _ORIGINALS[_CLASSES[cls]] = cls
    return _CLASSES[cls]


def _prepared_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                              top_k_weights: Tensor) -> Tensor:
    """A prepared MoE experts module's forward (moe.experts_forward); under a torch.func
    transform the module's own forward runs, as for prepared FFNs."""
    spec = getattr(self, _SPEC)
    if _transform_depth() > 0 or (spec.skip_dense and _experts_dense_reason(
            hidden_states.device, spec.experts, spec.l1_scale,
            torch.is_grad_enabled() and self.gate_up_proj.requires_grad,
            path_for(spec.path, torch.is_grad_enabled())) is not None):
        return _ORIGINALS[type(self)].forward(self, hidden_states, top_k_index, top_k_weights)
    return moe.experts_forward(self, spec, hidden_states, top_k_index, top_k_weights)


@torch.compiler.assume_constant_result
def _experts_dense_reason(device: torch.device, experts: int, l1: float, training: bool,
                          path: str) -> Optional[str]:
    """select.experts_reason, a constant to Dynamo as _dense_reason is."""
    return experts_reason(device, experts, training=training, l1=l1, path=path)


def _prepared_experts_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Twell{cls.__name__}", (cls,), {"forward": _prepared_experts_forward,
                                                               "__module__": __name__,
                                                               "__reduce_ex__": _prepared_reduce_ex})
        _ORIGINALS[_CLASSES[cls]] = cls
    return _CLASSES[cls]


def _experts_match(module: nn.Module) -> tuple[Optional[str], str]:
    """The activation of a batched experts module's experts when prepare can take it, else a
    reason: the decorator's flags, then the matcher on one expert's body."""
    why = moe.experts_reason(module)
    if why is not None:
        return None, why
    gm, _, why = _trace(moe.expert_body(module))
    if gm is None:
        return None, f"one expert's body: {why}"
    found = find_ffns(gm.graph)
    if len(found) != 1:
        return None, "one expert's body is not exactly one FFN"
    if not isinstance(found[0], Match):
        return None, found[0].reason
    if found[0].up is None or found[0].gate.rows is None or found[0].gate.rows[0] != 0:
        return None, "its gate_up_proj is not split gate-first into gate and up"
    return found[0].act, ""


def spec_of(module: nn.Module) -> Optional[FFNSpec]:
    """The FFNSpec of a prepared module, else None."""
    return getattr(module, _SPEC, None) if type(module) in _CLASSES.values() else None


# ------------------------------------------------------------------------------ entry point
DOWN_LAYOUTS = ("linear", "transposed")


def _store_transposed(w: Tensor) -> bool:
    """Give the parameter ``w`` [K_out, N] storage in [N, K_out] rows behind the same shape
    (``.data``: the same Parameter object, so optimizers and tied modules keep it). Returns
    whether its storage changed."""
    if w.dim() != 2 or w.t().is_contiguous() or _is_dtensor(w):
        return False
    with torch.no_grad():
        w.data = w.detach().t().contiguous().t()
    return True


def prepare(model: nn.Module, options: Optional[Mapping[str, Any]] = None, *,
            down_layout: str = "linear") -> Report:
    """Make every ReLU FFN module of ``model`` one twell op call, in place; call before DDP/FSDP2.

    ``model = MyModel(); twell_compile.prepare(model); model = DDP(model)`` (or ``fully_shard``
    per block), then ``torch.compile(model, backend="twell")`` as usual. ``options`` takes the
    ``twell.*`` keys of torch.compile's options; for prepared FFNs they are fixed here (give
    ``twell.l1`` here, not to torch.compile: under DDP a rank's graph is split and cannot count
    the model's FFNs; ``twell.l1_layers`` overrides the count of prepared FFNs). A module is
    prepared only if its whole forward is exactly one ReLU FFN (see the module docstring).
    Preparing twice leaves prepared modules as they are; ``unprepare`` undoes it.

    ``down_layout="transposed"`` also gives each prepared FFN's down weight [K_out, N] storage
    in [N, K_out] rows, the same shape and values (``weight.data`` is replaced once; the
    Parameter object stays): the CUDA per-row kernels read W_down's rows by hidden unit, and
    with nn.Linear's storage each call first transposes it (14 us of a 2048-token call's ~190
    on the H100, profile_product.py --M 2048 --down-layout transposed). Dense matmuls take
    either layout at the same speed; state_dict saves and loads the values as always. For
    inference: in training the weight's gradient takes the same layout (one strided copy per
    step), and FSDP2 shards a contiguous copy (the layout is then lost, not broken).

    Returns a ``Report`` with ``by_prepare=True`` (``print`` shows a table; fields in
    ``Report``'s docstring): ``.rewrites`` has one ``RewriteEntry`` per module prepared by this
    call, with ``layer`` its path in ``model`` ("root" when the model itself is one), ``gated``,
    ``k``/``n``/``k_out`` its input features, hidden units and output features (elements),
    ``dtype`` its weights' dtype, ``op="prepared"`` (``twell::ffn`` or ``twell::ffn_train`` is
    picked at each call by grad mode), ``tokens_shape="any"`` and ``via="prepare"``;
    ``.rejections`` lists FFN-like modules (two or three weight matrices) left as they are,
    with the reason. ``graphs`` is 0 and ``mode`` "" (nothing is traced by Dynamo).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if down_layout not in DOWN_LAYOUTS:
        raise ValueError(f"down_layout must be one of {DOWN_LAYOUTS}, got {down_layout!r}")
    if isinstance(model, nn.parallel.DistributedDataParallel) or type(model).__name__.startswith("FSDP"):
        raise ValueError(f"model is already wrapped ({type(model).__name__}): call prepare on the plain "
                         "model, then wrap it with DDP or fully_shard")
    config, rest = TwellConfig.from_options(options)
    if rest:
        key = sorted(map(str, rest))[0]
        ours = [PREFIX + f.name for f in dataclasses.fields(TwellConfig)]
        raise ValueError(f"options: prepare takes only twell.* keys, got {sorted(map(str, rest))}"
                         f"{did_you_mean(PREFIX + key if PREFIX + key in ours else key, ours)}")
    report = Report(by_prepare=True)
    found: list[tuple[nn.Module, FFNSpec, tuple[Read, ...]]] = []
    taken: list[str] = []                  # prepared module paths: their ancestors are not candidates
    experts: list[tuple[nn.Module, moe.ExpertsSpec]] = []
    for name, module in reversed(list(model.named_modules())):
        if spec_of(module) is not None:
            taken.append(name)
            continue
        if moe.is_batched_experts(module) and not any(t.startswith(name + ".") or not name for t in taken):
            act, why = _experts_match(module)
            if act is None:
                report.add_rejection(RejectionEntry(name or ROOT_LAYER, why, ""))
                continue
            n = module.gate_up_proj.shape[-1 if module.is_transposed else -2] // 2
            experts.append((module, moe.ExpertsSpec(name or ROOT_LAYER, int(module.gate_up_proj.shape[0]), int(n),
                                                    act, config.ell_width, config.backup_rows, 0.0, config.stats,
                                                    config.path, skip_dense=config.skip_dense)))
            taken.append(name)
            continue
        if any(t.startswith(name + ".") or not name for t in taken) or not _candidate(module):
            continue
        gm, reads, why = _trace(module)
        projs = None
        if gm is not None:
            projs, why = _projections(module, gm)
        if projs is None:
            if why and gm is not None:
                report.add_rejection(RejectionEntry(name or ROOT_LAYER, why, ""))
            elif why:
                log.debug("twell prepare: %s not traced: %s", name or ROOT_LAYER, why)
            continue
        spec = FFNSpec(name or ROOT_LAYER, *projs[:3], config.ell_width, config.backup_rows, 0.0, config.stats,
                       config.skip_dense, config.path, arg=_input_name(module), act=projs[3])
        found.append((module, spec, reads))
        taken.append(name)
    if isinstance(config.target_density, tuple):
        layers = [spec.layer for _, spec, _ in found]
        for name, _ in config.target_density:
            if name not in layers:
                raise ValueError(f"twell option {PREFIX}target_density names {name!r}, which is no FFN prepare "
                                 f"found{did_you_mean(name, layers)}; its FFNs: {layers[:8]}"
                                 f"{' ...' if len(layers) > 8 else ''} (module paths from the model)")
    if not found and not experts:
        return report
    scale = config.l1_scale(len(found) + len(experts))
    for module, spec in reversed(experts):
        if config.target_for(spec.layer) is not None:
            raise ValueError(f"{PREFIX}target_density asks a density of {spec.layer}, a MoE block's experts, "
                             "which the controller does not steer: name its other FFNs, or use twell.l1")
        number = tag(spec.layer)
        spec = dataclasses.replace(spec, instance=int(number),
                                   l1_scale=0.0 if config.target_density is not None else float(scale))
        setattr(module, _SPEC, spec)
        setattr(module, _TAG, number)
        setattr(module, _READS, ())
        setattr(module, _FALLBACK, None)
        module.__class__ = _prepared_experts_class(type(module))
        k = module.gate_up_proj.shape[-2 if module.is_transposed else -1]
        k_out = module.down_proj.shape[-1 if module.is_transposed else -2]
        report.add_rewrite(RewriteEntry(spec.layer, True, "prepared", "any", int(k), spec.n, int(k_out),
                                        str(module.gate_up_proj.dtype).replace("torch.", ""), "", via="prepare",
                                        act=spec.act, experts=spec.experts))
    for module, spec, reads in reversed(found):
        target = config.target_for(spec.layer)
        if target is not None:
            control.configure(spec.layer, target, config.target_steps, config.target_l1_init)
            spec = dataclasses.replace(spec, l1_scale=config.layer_scale(len(found)), l1_control=True)
        else:
            spec = dataclasses.replace(spec, l1_scale=float(scale))
        setattr(module, _SPEC, spec)
        setattr(module, _READS, reads)
        setattr(module, _FALLBACK, None)
        _retag(module)
        module.__class__ = _prepared_class(type(module))
        wg = _get(module, spec.gate.weight)
        wd = _get(module, spec.down.weight)
        if down_layout == "transposed" and not spec.down.transposed and spec.down.rows is None:
            _store_transposed(wd)
        n = spec.gate.rows[1] - spec.gate.rows[0] if spec.gate.rows else (wg.shape[1] if spec.gate.transposed else wg.shape[0])
        k = wg.shape[0] if spec.gate.transposed else wg.shape[1]
        k_out = wd.shape[1] if spec.down.transposed else wd.shape[0]
        report.add_rewrite(RewriteEntry(spec.layer, spec.up is not None, "prepared", "any", int(k), int(n),
                                        int(k_out), str(wg.dtype).replace("torch.", ""), "", via="prepare",
                                        act=spec.act))
    return report


def unprepare(model: nn.Module) -> int:
    """Restore the original class (and forward) of every prepared module of ``model``, in place.

    Returns the number of modules restored (0 if none was prepared). Parameters, buffers and
    state_dict are untouched: prepare never copies weights.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    count = 0
    originals = {v: k for k, v in _CLASSES.items()}
    for module in model.modules():
        cls = type(module)
        if cls in originals:
            module.__class__ = originals[cls]
            for attr in (_SPEC, _TAG, _READS, _FALLBACK):
                delattr(module, attr)
            count += 1
    return count


__all__ = ["prepare", "unprepare", "run_ffn", "spec_of", "FFNSpec", "ProjSpec"]
