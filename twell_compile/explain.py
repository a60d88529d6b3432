"""``twell_compile.explain(model, *args, **kwargs)``: which FFNs the backend rewrites, and why not."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import torch

from twell_compile.config import TwellConfig
from twell_compile.report import Report


def explain(model: Callable[..., Any], *args: Any, options: Optional[Mapping[str, Any]] = None,
            **kwargs: Any) -> Report:
    """Trace ``model(*args, **kwargs)`` as torch.compile would and report the rewrite.

    Returns a ``Report`` with ``.rewrites`` (one per FFN replaced: layer path, gated or not,
    shapes, op) and ``.rejections`` (FFN-like blocks left to Inductor, with the reason).
    ``print(report)`` shows a table. The model runs once, with the rewritten graphs run
    eagerly (no Inductor); the current grad mode decides inference versus training ops.
    ``options`` takes the same ``twell.*`` keys as torch.compile's options.

    On a DDP- or FSDP2-wrapped model, call it on every rank: each reports its own graphs
    (``.graphs``, ``.rank``; entries name their graph when there are several). FFNs made ops by
    ``twell_compile.prepare`` are listed as rewrites with ``via="prepare"``; under DDP, FFNs cut
    apart by the bucket split are listed with that reason.
    """
    if not callable(model):
        raise TypeError(f"model must be callable (an nn.Module or function), got {type(model).__name__}")
    from twell_compile.backend import inductor_patches, with_cudagraphs

    config, rest = TwellConfig.from_options(options)
    config = with_cudagraphs(config, inductor_patches(config.mode or None, rest))
    report = Report()

    def capture(gm: torch.fx.GraphModule, example_inputs: list[Any], **_: Any):
        from twell_compile.passes import report_of, run_passes

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
    torch.compile(model, backend=capture)(*args, **kwargs)
    return report
