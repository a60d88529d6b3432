"""Reports ReLU FFNs cut apart by a graph boundary: their gate/up and ReLU end at the output.

Under DDP, Dynamo's DDPOptimizer splits the captured graph at gradient-bucket boundaries before
the backend sees it, so the backend gets gate(+up)+ReLU in one graph and the down projection in
the next: neither half is an FFN. While DDP's split is active, this pass finds the first half (a ReLU of a projection whose
value, through a product and identity-like nodes, reaches the graph output and no projection)
and records a rejection pointing to ``twell_compile.prepare``. Analysis only.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import fx

from twell_compile.config import TwellConfig
from twell_compile.passes.naming import layer_name, module_roots
from twell_compile.passes.pass_utils import (MUL_FNS, MUL_METHODS, graph_modules, is_fn, is_method, is_relu,
                                             is_transparent, report_of)
from twell_compile.passes.projections import as_projection, resolve_projection
from twell_compile.report import RejectionEntry


def ddp_split_active() -> Optional[int]:
    """DDP's bucket cap in bytes if Dynamo is splitting graphs for DDP right now, else None.

    Reads the state torch's ConvertFrame reads (torch 2.11-2.13); changes nothing."""
    if not torch.distributed.is_available():
        return None
    from torch._dynamo import config as dynamo_config, utils as dynamo_utils

    get_mode = getattr(dynamo_utils, "get_optimize_ddp_mode", None) or getattr(dynamo_config, "_get_optimize_ddp_mode")
    if get_mode() != "ddp_optimizer":
        return None
    ddp = torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()
    return None if ddp is None else int(ddp.bucket_bytes_cap)


def _reaches_output(relu: fx.Node) -> Optional[list[fx.Node]]:
    """Projections feeding the block if ``relu``'s value reaches the output without a projection."""
    projs = [resolve_projection(relu.args[0])]
    seen, todo, out = set(), [relu], False
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if u.op == "output":
                out = True
            elif as_projection(u) is not None:
                return None
            elif is_transparent(u) and u.args[0] is n:
                todo.append(u)
            elif (is_fn(u, MUL_FNS) or is_method(u, MUL_METHODS)) and len(u.args) == 2:
                other = u.args[1] if u.args[0] is n else u.args[0]
                p = resolve_projection(other) if isinstance(other, fx.Node) else None
                if p is not None:
                    projs.append(p)
                todo.append(u)
    return [p.out for p in projs] if out else None


def report_cuts(gm: fx.GraphModule, config: TwellConfig) -> fx.GraphModule:
    cap = ddp_split_active()
    if cap is None:
        return gm   # without DDP a ReLU value at the output is usually the model's own output
    report = report_of(gm)
    why = (f"cut apart by DDP's graph split at a gradient-bucket boundary (bucket_cap_mb="
           f"{cap / 2**20:g}, torch._dynamo.config.optimize_ddp): call twell_compile.prepare(model) "
           "before DDP(model) to keep each FFN one op")
    for sub_name, sub in graph_modules(gm):
        for node in sub.graph.nodes:
            if not (is_relu(node) and node.args and resolve_projection(node.args[0]) is not None):
                continue
            outs = _reaches_output(node)
            if outs is not None:
                report.add_rejection(RejectionEntry(layer_name(outs + [node], module_roots(gm)), why, sub_name))
    return gm
