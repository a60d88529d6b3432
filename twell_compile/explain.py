"""``twell_compile.explain(model, *args, options=None, **kwargs)``: which FFNs the backend
rewrites, and why not."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any, Callable, Mapping, Optional

import torch

from twell_compile import moe, stats
from twell_compile.backend import with_cudagraphs
from twell_compile.config import PREFIX, TwellConfig, did_you_mean, inductor_patches
from twell_compile.passes import report_of, run_passes
from twell_compile.prepare import spec_of
from twell_compile.report import RejectionEntry, Report

_OWN = "options"   # explain's only keyword of its own; every other keyword goes to the model


def explain(model: Callable[..., Any], *args: Any, options: Optional[Mapping[str, Any]] = None,
            **kwargs: Any) -> Report:
    """Trace ``model(*args, **kwargs)`` as ``torch.compile(model, backend="twell")`` would and
    report the rewrite.

    Signature: the model's inputs go exactly as to the model, positionally and by keyword
    (``explain(model, ids, attention_mask=mask)``, not ``explain(model, (ids,))``). explain's
    only own keyword is ``options``: the same dict as torch.compile's ``options`` (``twell.*``
    keys, validated like ``check_options``; other keys must be Inductor config keys). A keyword
    close to ``options`` (``opts=``, ``option=``: difflib ratio >= 0.6, same first letter) that
    the model's signature does not name, or a ``twell.*`` key given as a keyword, raises
    ``TypeError`` instead of reaching the model's ``**kwargs``.

    Returns a ``Report`` (fields and units in its docstring): ``.rewrites`` (one per FFN
    replaced: layer path, gated or not, shapes, op) and ``.rejections`` (FFN-like blocks left
    to Inductor, with the reason). ``print(report)`` shows a table.

    Mode: the grad mode of the call decides inference versus training ops, as it does for
    torch.compile; ``report.mode`` and the printed report say which was assumed: "training"
    under grad mode (FFNs whose weights or input require grad get ``twell::ffn_train``),
    "inference" under ``torch.no_grad()``/``torch.inference_mode()`` (``twell::ffn``).

    The model runs once, with the rewritten graphs run eagerly (no Inductor): the ops record
    ``layer_stats`` as a compiled call would (a failed call leaves them as they were). Dynamo's
    per-code cache entries and skip marks that this call created are removed when it returns or
    fails, so a later ``explain`` or ``torch.compile`` sees Dynamo as before (no recompile-limit
    drift, no frame left skipped). Dynamo can drop only all of a code object's entries: if the
    same model class was also compiled with ``torch.compile`` in this process, that compile's
    code for the frames explain compiled goes too (a ``RuntimeWarning`` says how many) and
    recompiles at its next call.

    If the model call fails, ``RuntimeError`` names what explain passed (``args``/``kwargs``
    types and shapes) and chains the model's exception.

    On a DDP- or FSDP2-wrapped model, call it on every rank: each reports its own graphs
    (``.graphs``, ``.rank``; entries name their graph when there are several). FFNs made ops by
    ``twell_compile.prepare`` are listed as rewrites with ``via="prepare"``; under DDP, FFNs cut
    apart by the bucket split are listed with that reason. A transformers MoE experts module
    whose ``experts_implementation`` the backend cannot match (``eager``: its loop graph-breaks;
    ``batched_mm``; hub kernels) is listed as left to Inductor with the implementation and why.
    """
    if not callable(model):
        raise TypeError(f"model must be callable (an nn.Module or function), got {type(model).__name__}")
    _check_keywords(model, kwargs)
    config, rest = TwellConfig.from_options(options)
    config = with_cudagraphs(config, inductor_patches(config.mode or None, rest))
    report = Report(mode="training" if torch.is_grad_enabled() else "inference")

    def capture(gm: torch.fx.GraphModule, example_inputs: list[Any], **_: Any):
        gm = run_passes(gm, config)
        index = report.graphs
        report.graphs += 1
        part = report_of(gm)
        # Name each entry's graph by its compile order, so several graphs (DDP's split) stay apart.
        tag = lambda g: f"{index}:{g}" if g else str(index)  # noqa: E731
        report.rewrites += [dataclasses.replace(r, graph=tag(r.graph)) for r in part.rewrites]
        report.rejections += [dataclasses.replace(r, graph=tag(r.graph)) for r in part.rejections]
        return gm.forward

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        report.rank = torch.distributed.get_rank()
    before, saved = _seen_codes(), stats.snapshot()
    try:
        torch.compile(model, backend=capture)(*args, **kwargs)
    except Exception as e:
        stats.restore(saved)   # ops that ran before the failure recorded layer_stats
        raise RuntimeError(_call_failure(e, args, kwargs)) from e
    finally:
        _forget_compiles(capture, before)
    _unmatched_experts(model, report)
    return report


def _unmatched_experts(model: Any, report: Report) -> None:
    """A rejection for each transformers experts module whose selected implementation the
    backend cannot match (``moe.unmatched_reason``), unless prepared or already reported."""
    if not isinstance(model, torch.nn.Module):
        return
    named = {e.layer for e in (*report.rewrites, *report.rejections)}
    for name, module in model.named_modules():
        name = name.removeprefix("_orig_mod.")
        if name in named or not moe.is_batched_experts(module) or spec_of(module) is not None:
            continue
        why = moe.unmatched_reason(module)
        if why is not None:
            report.add_rejection(RejectionEntry(name, why, ""))


def _model_keywords(model: Callable[..., Any]) -> set[str]:
    """Parameter names the model's signature takes by keyword (forward's, for a module)."""
    fn = model.forward if isinstance(model, torch.nn.Module) else model
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return set()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _check_keywords(model: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
    """Refuse keywords meant for explain that would otherwise vanish into the model's ``**kwargs``."""
    named = _model_keywords(model)
    for key in kwargs:
        if key in named:
            continue
        if key.startswith(PREFIX):
            raise TypeError(f"explain() got the twell option {key!r} as a keyword: pass it in the options dict, "
                            f"explain(model, *inputs, options={{{key!r}: ...}})")
        hint = did_you_mean(key, [_OWN]) if key[:1].lower() == _OWN[0] else ""
        if hint:
            raise TypeError(f"explain() got an unexpected keyword {key!r}{hint}: explain's only own keyword is "
                            f"options= (torch.compile's options dict); every other keyword goes to the model, and "
                            f"one this close to 'options' must be named in the model's signature. To pass it to the "
                            f"model anyway: explain(lambda *a: model(*a, {key}=...), *inputs)")


def _describe(value: Any, depth: int = 0) -> str:
    """Type and shape of an argument, e.g. ``Tensor[2, 5] int64`` or ``tuple(Tensor[2, 5] int64)``."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, (tuple, list)) and depth < 2:
        inner = ", ".join(_describe(v, depth + 1) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"{type(value).__name__}({inner})"
    if isinstance(value, dict) and depth < 2:
        inner = ", ".join(f"{k!r}: {_describe(v, depth + 1)}" for k, v in list(value.items())[:4])
        return "{" + inner + (", ..." if len(value) > 4 else "") + "}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value) if len(repr(value)) <= 40 else type(value).__name__
    return type(value).__name__


def _call_failure(e: Exception, args: tuple, kwargs: Mapping[str, Any]) -> str:
    passed = ", ".join(_describe(a) for a in args)
    passed = f"args=({passed}{',' if len(args) == 1 else ''}), kwargs={_describe(dict(kwargs))}"
    first = (str(e).strip().splitlines() or [""])[0][:300]
    hint = ""
    if any(isinstance(a, (tuple, list)) for a in args):
        hint = (". explain passes its positional arguments to the model as they are: pass the inputs as separate "
                "arguments, explain(model, x, y) or explain(model, *inputs), not explain(model, (x, y))")
    return f"explain called model(*args, **kwargs) with {passed} and it raised {type(e).__name__}: {first}{hint}"


def _seen_codes() -> set[int]:
    """Ids of the code objects Dynamo has intercepted so far (alive ones)."""
    from torch._dynamo import convert_frame

    return {id(c) for c in (r() for r in convert_frame.input_codes.seen) if c is not None}


def _forget_compiles(compiler_fn: Callable[..., Any], before: set[int]) -> None:
    """Remove the Dynamo state that compiling with ``compiler_fn`` created.

    Dynamo keeps compiled code per code object, across torch.compile calls: left in place,
    each explain adds one entry to the model's forward (the 9th explain of one model hit
    recompile_limit 8 and reported 0 graphs), and a frame Dynamo gave up on during a failed
    call stays skipped (the next explain compiled each block alone: names like "mlp"). Every
    code object holding an entry of this compile, or first seen during it, is reset whole
    (entries and skip marks), as torch._dynamo.reset does for all: an invalidated entry would
    stay in the code's list and count toward recompile_limit. Entries of other compiles on
    those code objects go too, with a warning. Uses Dynamo internals (torch 2.11-2.13).
    """
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code
    from torch._dynamo import convert_frame, eval_frame

    ours = lambda backend: getattr(backend, "compiler_fn", backend) is compiler_fn  # noqa: E731
    shared = 0
    with convert_frame.compile_lock:
        for ref in list(convert_frame.input_codes.seen):
            code = ref()
            if code is None:
                continue
            entries = _debug_get_cache_entry_list(code)
            mine = sum(ours(e.backend) for e in entries)
            if mine or id(code) not in before:
                shared += mine < len(entries)
                reset_code(code)
        for key, backend in list(eval_frame.cached_backends.items()):
            if ours(backend):
                del eval_frame.cached_backends[key]
    if shared:
        warnings.warn(f"twell_compile.explain dropped the compiled code of {shared} frame(s) it shared with another "
                      "torch.compile of the same model (Dynamo caches per code object and can only drop all of a "
                      "code's entries): that compiled model recompiles at its next call", RuntimeWarning, stacklevel=3)
