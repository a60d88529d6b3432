"""Mixture-of-experts blocks in transformers' batched-experts form, for ``prepare`` and ``explain``.

transformers 5.x holds a block's experts in one module (``MixtralExperts``, ``Qwen2MoeExperts``,
``Qwen3MoeExperts``, ``OlmoeExperts``, ...): ``gate_up_proj`` [E, 2N, K] and ``down_proj``
[E, K, N] parameters, decorated by ``use_experts_implementation``, which picks the forward by
``config._experts_implementation``. Every implementation computes the same function of
(hidden_states [T, K], top_k_index [T, k], top_k_weights [T, k]), given the flags the
decorator sets (``has_gate``, ``has_bias``, ``is_transposed``, ``is_concatenated``; decorators
that support a norm after each expert add ``has_post_expert_norm``): ``prepare`` relies on that
contract and gives a recognised module a forward of its own (``experts_forward``) that groups
the routed rows by expert and calls ``twell::experts`` / ``twell::experts_train``; the router
before it stays the model's.

Under expert parallelism each rank holds a slice of the experts and the router marks the rows of
other ranks' experts with the sentinel id ``num_experts`` (the local count); ``experts_reason``
refuses such a module. Decorators that record it set ``_is_expert_parallel``; for the others the
split shows as weights sharded into DTensors, a ``num_experts`` other than the weights' expert
count, a forward installed on the instance by the parallel plan, or the config's
``distributed_config.enable_expert_parallel``. A module with neither ``_is_expert_parallel`` nor
``num_experts`` gives nothing to tell by, and is refused.

The expert's activation is read by the backend's matcher: ``_apply_gate`` (the decorator's
``act_fn(gate) * up`` or the class's own) is traced with torch.fx between two linear maps of
one expert's shapes, on the meta device, and must be one ReLU-family FFN (ReLU, squared ReLU,
dReLU); SiLU or GELU experts are left as they are, with the matcher's reason.

Under ``torch.compile`` without ``prepare`` the backend matches the ``grouped_mm``
implementation (the default) itself (``passes/match_ffn.py``); ``unmatched_reason`` says why
the others are not matched, for ``explain``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from twell_compile.config import path_for

# The flags every version of use_experts_implementation sets on each experts module; the
# decorators with a post-expert norm option also set has_post_expert_norm, and those that record
# expert parallelism set _is_expert_parallel.
_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")

# Why the backend cannot match an implementation's graph (``grouped_mm`` it matches).
_UNMATCHED = {
    "eager": ("its loop over the experts hit (expert_hit, a data-dependent nonzero) graph-breaks: the experts "
              "run outside every graph. Keep transformers' default experts_implementation=\"grouped_mm\", or "
              "call twell_compile.prepare(model) (it gives the experts module a twell forward)"),
    "batched_mm": ("it gathers each routed token's own copy of its expert's weights (bmm over [S, 2N, K]): no "
                   "per-expert FFN in the graph to match. Use experts_implementation=\"grouped_mm\" (the "
                   "default) or twell_compile.prepare(model)"),
}


def _implementation(module: nn.Module) -> Optional[str]:
    return getattr(getattr(module, "config", None), "_experts_implementation", None)


def is_batched_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module of the batched form (the decorator's
    flags and ``_apply_gate``, ``gate_up_proj`` or ``up_proj`` and ``down_proj`` 3-D parameters)."""
    if not all(isinstance(getattr(module, f, None), bool) for f in _FLAGS):
        return False
    if not callable(getattr(type(module), "_apply_gate", None)):
        return False
    up = getattr(module, "gate_up_proj", None)
    if up is None:
        up = getattr(module, "up_proj", None)
    down = getattr(module, "down_proj", None)
    return isinstance(up, Tensor) and isinstance(down, Tensor) and up.dim() == 3 and down.dim() == 3


def unmatched_reason(module: nn.Module) -> Optional[str]:
    """Why the backend cannot match this experts module's selected implementation, or None
    (``grouped_mm``, which it matches, or no implementation recorded)."""
    impl = _implementation(module)
    if impl is None or impl == "grouped_mm":
        return None
    why = _UNMATCHED.get(impl, "an opaque kernel call for the whole block: no per-expert FFN in the graph to match. "
                               "Use experts_implementation=\"grouped_mm\" (the default) or twell_compile.prepare(model)")
    return f"experts_implementation={impl!r}: {why}"


@dataclass(frozen=True)
class ExpertsSpec:
    """A prepared experts module: its layer name, experts count, activation, the options
    prepare fixed, and its op instance."""

    layer: str
    experts: int
    n: int
    act: str
    ell_width: int
    backup_rows: int
    l1_scale: float
    stats: bool
    path: str
    instance: int = 0
    skip_dense: bool = True     # twell.skip_dense: where the compile-time rule says the experts
                                # run slower than their own grouped form, that form runs


class _ExpertBody(nn.Module):
    """One expert as the batched forward computes it: down(_apply_gate(gate_up(x))), on meta
    weights of one expert's shape, for the matcher."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        up, down = experts.gate_up_proj, experts.down_proj
        shape_up = up.shape[1:] if not experts.is_transposed else up.shape[1:][::-1]
        shape_down = down.shape[1:] if not experts.is_transposed else down.shape[1:][::-1]
        self.gate_up = nn.Parameter(torch.empty(shape_up, dtype=up.dtype, device="meta"))
        self.down = nn.Parameter(torch.empty(shape_down, dtype=down.dtype, device="meta"))
        self.act_fn = experts.act_fn
        self._gate = type(experts)._apply_gate

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self._gate(self, F.linear(x, self.gate_up)), self.down)


def experts_reason(module: nn.Module) -> Optional[str]:
    """Why prepare cannot give this experts module the twell forward (its flags), or None."""
    if not module.has_gate:
        return "its experts have no gate (up_proj only): only gated experts are prepared"
    if module.has_bias:
        return "its experts have biases (added per routed row): not prepared"
    if not module.is_concatenated:
        return "its gate and up rows are interleaved (is_concatenated=False): not prepared"
    # A decorator without the has_post_expert_norm option applies no norm after the experts.
    if getattr(module, "has_post_expert_norm", False):
        return "a norm follows each expert (has_post_expert_norm): not prepared"
    return _parallel_reason(module)


def _is_dtensor(t: Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _parallel_reason(module: nn.Module) -> Optional[str]:
    """Why this experts module may be split over ranks (its router then emits sentinel expert
    ids, and a parallel plan wraps its forward), or None when it holds all its experts."""
    recorded = getattr(module, "_is_expert_parallel", None)
    if recorded:
        return "expert parallel (_is_expert_parallel; sentinel expert ids): not prepared"
    if any(_is_dtensor(p) for p in module.parameters(recurse=False)):
        return "its expert weights are DTensors (sharded by a tensor- or expert-parallel plan): not prepared"
    if "forward" in vars(module):
        return ("its forward is set on the instance (a parallel plan's or a hook's wrapper, bound to the class "
                "forward), so prepare's forward would not run: not prepared")
    distributed = getattr(getattr(module, "config", None), "distributed_config", None)
    if getattr(distributed, "enable_expert_parallel", False):
        return "the config enables expert parallelism (distributed_config.enable_expert_parallel): not prepared"
    held = module.gate_up_proj.shape[0]
    count = getattr(module, "num_experts", None)
    if isinstance(count, int) and count != held:
        return (f"num_experts is {count} but its weights hold {held} experts (an expert-parallel split; "
                "sentinel expert ids): not prepared")
    if recorded is None and not isinstance(count, int):
        return ("neither _is_expert_parallel nor num_experts is set: cannot tell whether its experts are split "
                "by expert parallelism: not prepared")
    return None


def expert_body(module: nn.Module) -> nn.Module:
    """The module holding one expert's FFN for the matcher (prepare traces it)."""
    return _ExpertBody(module)


def _weights(module: nn.Module) -> tuple[Tensor, Tensor]:
    """gate_up [E, 2N, K] and down [E, K_out, N] in nn.Linear's layout per expert."""
    up, down = module.gate_up_proj, module.down_proj
    if module.is_transposed:
        up, down = up.transpose(-2, -1), down.transpose(-2, -1)
    return up, down


def experts_forward(module: nn.Module, spec: ExpertsSpec, hidden_states: Tensor, top_k_index: Tensor,
                    top_k_weights: Tensor) -> Tensor:
    """The experts' output [T, K] for the routing given: rows sorted by expert, each expert's
    FFN by the twell op on its rows, weighted and summed per token as the grouped form does."""
    top_k = top_k_index.shape[-1]
    ids = top_k_index.reshape(-1)
    sorted_ids, perm = torch.sort(ids, stable=True)
    # each expert's end row among the sorted rows (static shapes: no histogram sync)
    offs = torch.searchsorted(sorted_ids, torch.arange(spec.experts, device=ids.device, dtype=ids.dtype),
                              right=True)
    x = hidden_states[perm // top_k]
    up, down = _weights(module)
    dev = x.device.type
    # As F.linear does: inside autocast the projections run in the autocast dtype; outside it,
    # operands of different dtypes are refused.
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
    elif up.dtype != x.dtype:
        raise RuntimeError(f"{spec.layer}: input is {x.dtype} but the expert weights are {up.dtype}, which "
                           "F.linear refuses outside autocast")
    else:
        dtype = x.dtype
    x, up, down = x.to(dtype), up.to(dtype), down.to(dtype)
    wg, wu = up[:, :spec.n], up[:, spec.n:]
    act = {"act": spec.act} if spec.act != "relu" else {}
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, up, down)):
        y = torch.ops.twell.experts_train.default(x, wg, wu, down, offs, spec.ell_width, spec.backup_rows,
                                                  spec.l1_scale, spec.layer, spec.stats, spec.instance,
                                                  path_for(spec.path, True), **act)[0]
    else:
        y = torch.ops.twell.experts.default(x, wg, wu, down, offs, spec.layer, spec.stats, spec.instance,
                                            path_for(spec.path, False), **act)
    y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(y.dtype)
    out = torch.empty_like(y)
    out[perm] = y
    return out.view(-1, top_k, y.shape[-1]).sum(dim=1).to(hidden_states.dtype)


__all__ = ["ExpertsSpec", "expert_body", "experts_forward", "experts_reason", "is_batched_experts",
           "unmatched_reason"]
