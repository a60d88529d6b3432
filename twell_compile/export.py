"""``twell_compile.export``: torch.export with the twell rewrite applied.

torch.export traces below the level our pass works at, so the model is first captured by
Dynamo (torch-level graph), rewritten by the same passes as the backend, then exported. The
program calls ``torch.ops.twell.*``: a process that runs it, also through an AOTInductor
package, must ``import twell_compile.ops`` first (the ops are Python custom ops). Without
that, loading fails with "Could not find schema for twell::ffn". AOTInductor packages need
torch >= 2.13: on torch 2.11 running the package segfaulted in its call of the Python op.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from twell_compile.config import TwellConfig
from twell_compile.report import Report


def export(model: torch.nn.Module, args: tuple, kwargs: Optional[Mapping[str, Any]] = None, *,
           dynamic_shapes: Any = None, options: Optional[Mapping[str, Any]] = None
           ) -> tuple[torch.export.ExportedProgram, Report]:
    """Export ``model(*args, **kwargs)`` with its ReLU FFNs replaced by twell ops.

    Returns the ExportedProgram and the rewrite report. Exports for inference (no autograd):
    run it under ``torch.no_grad()`` semantics. ``dynamic_shapes`` is passed to
    ``torch.export.export``; ``options`` takes the ``twell.*`` keys of torch.compile.
    """
    from twell_compile.passes import report_of, run_passes

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple of inputs, got {type(args).__name__}")
    config, rest = TwellConfig.from_options(options)
    if rest:
        raise ValueError(f"export takes only twell.* options, got {sorted(rest)}")
    kwargs = dict(kwargs or {})
    with torch.no_grad():
        gm, _guards = torch._dynamo.export(model)(*args, **kwargs)
        gm = run_passes(gm, config)
        ep = torch.export.export(gm, args, kwargs, dynamic_shapes=dynamic_shapes)
    return ep, report_of(gm)
