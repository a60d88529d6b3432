"""Op instance numbers, and each call's layer name resolved from the module its weights belong to.

Dynamo compiles one graph for every module that runs the same code with parameters of the same
shapes (a block class compiled on its own, ``module.compile()`` on every layer, a second model of
the same class): the parameters are graph inputs, and the layer name and op instance the passes
wrote into the op are the first module's. The backend therefore hands each op it inserts, as the
argument ``owner``, the down projection's weight as the graph received it, and declares here
(``declare``) the op's compile-time layer and that weight's path below the layer
(``down_proj.weight``). A call resolves (``resolve``) its layer from the weight's name in the
model that holds it: ``model.layers.3.mlp.down_proj.weight`` gives ``model.layers.3.mlp``.

The lookup is keyed on the weight object (the graph passes the module's own Parameter to the
op) and cached per op instance: a hit is one dict read and a check that the cached parameter is
this one; nothing is read from the device, and a parameter whose storage changes (``.data =``,
FSDP2's resized unsharded parameters) keeps its entry. A miss (a parameter first seen) names the
parameters of the modules on the Python call stack (the model's own call is among them, as it is
at compile time for the passes' names) and caches every one of them. Instance numbers go by
(model, layer): the first an op instance sees keeps the op's number, every other one gets a
fresh number once, so each layer (and each model) keeps its own runtime state, as separately
compiled ops do, and a new Parameter object at a known place keeps its place's. A weight that no
module on the stack holds runs under the op's own instance and compile-time layer.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

from torch import Tensor, nn

_instances = itertools.count(1)


def next_instance() -> int:
    """A fresh op instance number (ops' ``instance`` argument), unique in this process."""
    return next(_instances)


def unwrap(module: nn.Module) -> nn.Module:
    """The user's module inside the wrappers that add a prefix to its parameters' names
    (torch.compile's OptimizedModule, DistributedDataParallel, DataParallel)."""
    while True:
        inner = getattr(module, "_orig_mod", None)        # torch.compile's OptimizedModule
        if not isinstance(inner, nn.Module) and isinstance(module, (nn.parallel.DistributedDataParallel,
                                                                    nn.DataParallel)):
            inner = module.module
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def caller_modules() -> list[nn.Module]:
    """The modules whose methods are running on this thread's Python stack (their ``self``),
    outermost first, wrappers unwrapped. A backend runs while Dynamo compiles a frame, and an op
    while its compiled graph runs, inside the calls that reached them: the model's own call is
    among them."""
    out: dict[int, nn.Module] = {}
    frame = sys._getframe(1)
    while frame is not None:
        me = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if isinstance(me, nn.Module):
            me = unwrap(me)
            out.setdefault(id(me), me)
        frame = frame.f_back
    return list(reversed(out.values()))


@dataclass
class _Declared:
    layer: str                               # the compile-time name
    suffix: str                              # the owner weight's path below the layer
    on_layer: Optional[Callable[[str], None]] = None    # called once per other layer resolved
    numbers: dict[tuple[int, str], int] = field(default_factory=dict)   # (model, layer) -> instance


MAX_RESOLVED = 1 << 16              # cached owners (cleared past this: parameters made per call)
_declared: dict[int, _Declared] = {}
# (op instance, id(owner)) -> (owner, the call's instance, its layer)
_resolved: dict[tuple[int, int], tuple[weakref.ref, int, str]] = {}
_params: dict[int, tuple[weakref.ref, str, int]] = {}   # id(parameter) -> (parameter, its name, id(its model))


def declare(instance: int, layer: str, suffix: str) -> None:
    """Op ``instance`` was written with ``layer``; its owner weight is ``{layer}.{suffix}``."""
    _declared[instance] = _Declared(layer, suffix)


def on_new_layer(instance: int, fn: Callable[[str], None]) -> None:
    """Call ``fn(layer)`` when op ``instance`` first resolves a layer other than its own (the
    backend configures that layer's L1 controller)."""
    _declared[instance].on_layer = fn


def _param_name(owner: Tensor) -> tuple[Optional[str], int]:
    """The owner's name in the outermost model on the stack holding it, and that model's id;
    (None, 0) where none holds it."""
    hit = _params.get(id(owner))
    if hit is not None and hit[0]() is owner:
        return hit[1], hit[2]
    if len(_params) >= MAX_RESOLVED:
        _params.clear()
    for model in caller_modules():
        for name, p in model.named_parameters(remove_duplicate=False):
            old = _params.get(id(p))
            if old is None or old[0]() is not p:
                _params[id(p)] = (weakref.ref(p), name, id(model))
        hit = _params.get(id(owner))
        if hit is not None and hit[0]() is owner:
            return hit[1], hit[2]
    return None, 0


def _layer_of(d: _Declared, path: Optional[str]) -> str:
    """The layer whose owner weight is at ``path`` (the compile-time layer when it is not one
    of the declared form)."""
    if path is None:
        return d.layer
    if path == d.suffix:                # the model's own forward holds the FFN
        return d.layer
    if path.endswith("." + d.suffix):
        return path[:-len(d.suffix) - 1]
    return d.layer


def _resolve_miss(owner: Tensor, instance: int, layer: str) -> tuple[int, str]:
    d = _declared.get(instance)
    if d is None:                   # an op not inserted by the passes of this process
        return instance, layer
    path, model = _param_name(owner)
    name = _layer_of(d, path)
    # one instance per (model, layer): the first pair keeps the op's own number, and a new
    # Parameter object at a known place (a module's weight re-assigned) keeps its place's
    number = d.numbers.get((model, name))
    if number is None:
        new_layer = name != d.layer and all(seen != name for _, seen in d.numbers)
        number = instance if not d.numbers else next_instance()
        d.numbers[(model, name)] = number
        if new_layer and d.on_layer is not None:
            d.on_layer(name)
    if len(_resolved) >= MAX_RESOLVED:
        _resolved.clear()
    _resolved[(instance, id(owner))] = (weakref.ref(owner), number, name)
    return number, name


def resolve(owner: Optional[Tensor], instance: int, layer: str) -> tuple[int, str]:
    """The (instance, layer) a call runs as: the op's own without ``owner``, else those of the
    module that holds ``owner`` (cached; see the module docstring)."""
    if owner is None:
        return instance, layer
    hit = _resolved.get((instance, id(owner)))
    if hit is not None and hit[0]() is owner:
        return hit[1], hit[2]
    return _resolve_miss(owner, instance, layer)


def reset() -> None:
    """Forget every resolved owner (their layers are looked up again on the next call)."""
    _resolved.clear()
    _params.clear()
    for d in _declared.values():
        d.numbers.clear()


__all__ = ["caller_modules", "declare", "next_instance", "on_new_layer", "resolve", "reset", "unwrap"]
