"""Graph rewrites of the twell backend, installed as ``twell_compile.passes``.

Every pass is a ``(graph_module, config) -> graph_module`` function that cleans up after itself
(dead nodes removed, graph linted, code recompiled). ``PASSES`` is the one ordered list the
backend applies; each pass records what it did in ``report_of(gm)``. Shared graph helpers live
in ``pass_utils``. The passes import only the ops (and their compile-time plan), the config,
the formats and the report: never the runtime or the kernels.
"""

from __future__ import annotations

from torch import fx

from twell_compile.config import TwellConfig
from twell_compile.passes.adopt_prepared import adopt_prepared
from twell_compile.passes.fuse_ffn import fuse_ffn
from twell_compile.passes.pass_utils import graph_modules, report_of
from twell_compile.passes.report_cuts import report_cuts
from twell_compile.passes.scale_l1 import scale_l1

PASSES = (adopt_prepared, fuse_ffn, report_cuts, scale_l1)


def run_passes(gm: fx.GraphModule, config: TwellConfig) -> fx.GraphModule:
    # DDP's graph split gives every piece the same meta dict (torch's propagate_metadata): give
    # this graph its own, with a fresh report, so pieces do not add up each other's entries.
    gm.meta = {k: v for k, v in gm.meta.items() if k != "twell_report"}
    report_of(gm)
    for p in PASSES:
        gm = p(gm, config)
    return gm


__all__ = ["PASSES", "run_passes", "report_of", "graph_modules", "adopt_prepared", "fuse_ffn", "report_cuts",
           "scale_l1"]
