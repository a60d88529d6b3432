"""``twell_compile.explain(model, *args, **kwargs)``: which FFNs the backend rewrites, and why not."""

from __future__ import annotations

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
    """
    if not callable(model):
        raise TypeError(f"model must be callable (an nn.Module or function), got {type(model).__name__}")
    config, _ = TwellConfig.from_options(options)
    report = Report()

    def capture(gm: torch.fx.GraphModule, example_inputs: list[Any], **_: Any):
        from twell_compile.passes import report_of, run_passes

        gm = run_passes(gm, config)
        report.extend(report_of(gm))
        return gm.forward

    torch.compile(model, backend=capture)(*args, **kwargs)
    return report
