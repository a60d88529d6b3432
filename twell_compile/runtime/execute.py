"""Runs an op call: reads its cached plan (or asks ``select`` for one), then calls the plan's
launcher.

    ffn_infer            twell::ffn            cached plan -> cuda_infer / cuda_decode / cpu_ffn / torch_impl
    ffn_train_forward    twell::ffn_train      plan_train -> cuda_train / torch_impl
    ffn_train_backward   twell::ffn_train_bwd  the path the saved state's shapes say

Every call runs inside its op instance's scope (density.enter), so the measurements it reads
and writes are its own op's. Inference plans are cached per op instance, layer, device, dtype,
shapes, flags and path: a call reads its plan, takes a landed density measurement if one is
pending, and decides only whether to probe this call (the plan's interval); a landed
measurement (the layer state's version), ``density.reset``, ``arch.patched`` or a change of
deterministic mode makes a new plan. Under CUDA-graph capture plans are made afresh (nothing is
probed there). No host sync on any path: decisions use shapes, dtypes, devices
and lagged device-side counts only. The CUDA launchers import Triton, so they are imported on
first use (``import twell_compile.ops`` stays light on machines without it).
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from twell_compile import control
from twell_compile.runtime import arch, density, select, torch_impl

log = logging.getLogger("twell_compile")
_warned_fp16_l1 = False
MAX_PLANS = 4096                   # cached inference plans (cleared past this: a token count per call)
_plans: dict[tuple, tuple] = {}    # cache key -> (plan, its layer state or None, the state's version)


def infer_plan(x: Tensor, n: int, k_out: int, gated: bool, layer: str, keep_stats: bool, instance: int,
               path: str) -> select.InferPlan:
    """The call's plan: the cached one while its layer's density state has not moved and this
    call is not due to probe (the plan's interval); else select.plan_infer's (a probe call's
    flags are the rules', e.g. a dense probe counts instead of replaying a graph), cached when
    it probes nothing."""
    ck = (instance, layer, x.device, x.dtype, x.shape, n, k_out, gated, keep_stats, path,
          torch.are_deterministic_algorithms_enabled(), arch.generation, density.generation)
    capturing = x.is_cuda and density.capturing()
    hit = _plans.get(ck)
    if hit is not None and not capturing:
        plan, st, version = hit
        if st is None:
            return plan
        density.take_landed(st)
        if st.version == version and not density.due(st, plan.every):
            return plan
    plan = select.plan_infer(x, n, k_out, gated, layer, keep_stats, path)
    if not capturing and not plan.probe:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        st = density.state(plan.key) if plan.tick else None
        _plans[ck] = (plan, st, None if st is None else st.version)
    return plan


def _cuda_infer() -> ModuleType:
    from twell_compile.runtime import cuda_infer

    return cuda_infer


def _cuda_train() -> ModuleType:
    from twell_compile.runtime import cuda_train

    return cuda_train


def ffn_infer(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
              b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor], layer: str,
              keep_stats: bool, instance: int = 0, path: str = "auto", act: str = "relu") -> Tensor:
    """The inference FFN y [..., K_out] for x [..., K]; weights in nn.Linear's layout; ``act``:
    the activation (reference.ACTS), which every launcher takes."""
    n, k_out = w_gate.shape[0], w_down.shape[0]
    prev = density.enter(instance)
    try:
        plan = infer_plan(x, n, k_out, w_up is not None, layer, keep_stats, instance, path)
        if plan.path == "torch":
            return torch_impl.ffn_infer(x, w_gate, b_gate, w_up, b_up, w_down, b_down, layer, keep_stats, act)
        if plan.path == "cpu":
            from twell_compile.runtime import cpu_ffn

            return cpu_ffn.ffn_infer(x, w_gate, b_gate, w_up, b_up, w_down, b_down, layer, keep_stats, plan.policy,
                                     act)
        y = _cuda_infer().ffn_infer(plan, x, w_gate, b_gate, w_up, b_up, w_down, b_down, layer, keep_stats, act)
        if plan.tick:
            density.tick(plan.key, plan.path)
        return y
    finally:
        density.enter(prev)


def ffn_train_forward(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                      b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
                      ell_width: int, backup_rows: int, layer: str, keep_stats: bool,
                      instance: int = 0, path: str = "auto", l1_scale: float = 0.0, act: str = "relu",
                      l1_control: bool = False) -> tuple[Tensor, ...]:
    """(y, counts, cols, ell_g, ell_u, backup_idx, backup_g, backup_u, l1_coef): formats.Hybrid's
    state and the coefficient the backward applies (``l1_control``: the layer's controller's,
    control.on_call; else empty). ``l1_scale``: the backward's (the first call of a layer that
    may switch path runs every path's kernels once with it: cuda_train.warm_paths)."""
    global _warned_fp16_l1
    if l1_scale and x.dtype == torch.float16 and not _warned_fp16_l1:
        _warned_fp16_l1 = True
        log.warning("twell: the L1 penalty (twell.l1) trains in float16 here; it is added in the backward "
                    "unscaled, so torch.amp.GradScaler's unscaling divides it by the loss scale (it all but "
                    "vanishes): train in bfloat16, or multiply twell.l1 by the scaler's scale")
    n, k_out = w_gate.shape[0], w_down.shape[0]
    prev = density.enter(instance)
    try:
        plan = select.plan_train(x, n, k_out, w_up is not None, ell_width, backup_rows, layer, path)
        if plan.path == "torch":
            out = torch_impl.ffn_train_forward(x, w_gate, b_gate, w_up, b_up, w_down, b_down,
                                               ell_width, backup_rows, layer, keep_stats, act)
            return (*out, _coef(out[1], n, layer, l1_control))
        if path == "auto" and plan.tick:    # a plan that may switch path: every path's kernels built now
            warm_coef = x.new_ones((1,), dtype=torch.float32) if l1_control else None
            _cuda_train().warm_paths(plan, x, w_gate, b_gate, w_up, b_up, w_down, b_down, l1_scale, keep_stats,
                                     act, warm_coef)
        out = _cuda_train().ffn_train_forward(plan, x, w_gate, b_gate, w_up, b_up, w_down, b_down,
                                              layer, keep_stats, act)
        if plan.tick:
            density.tick(plan.key)
        density.record_path(plan.key, plan.path)
        return (*out, _coef(out[1], n, layer, l1_control))
    finally:
        density.enter(prev)


def _coef(counts: Tensor, n: int, layer: str, l1_control: bool) -> Tensor:
    """The training call's ``l1_coef`` output: empty without ``l1_control``; else its layer's
    controller counts the call's non-zeros (one reduction, no sync) and hands back the
    coefficient (zero for a layer the per-layer target names not)."""
    if not l1_control:
        return counts.new_empty((0,), dtype=torch.float32)
    coef = control.on_call(layer, counts.sum(dtype=torch.float64), counts.numel() * n)
    return coef if coef is not None else counts.new_zeros((1,), dtype=torch.float32)


def ffn_train_backward(dy: Tensor, x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor],
                       w_up: Optional[Tensor], b_up: Optional[Tensor], w_down: Tensor, *state: Tensor,
                       l1_scale: float, l1_coef: Optional[Tensor] = None, act: str = "relu"
                       ) -> tuple[Optional[Tensor], ...]:
    """Gradients (dx, dw_gate, db_gate, dw_up, db_up, dw_down, db_down) from the saved state:
    the CUDA backward where the CUDA training kernels take the call (its path follows the
    state's shapes), plain PyTorch otherwise. ``l1_coef`` ([1] device tensor, or None)
    multiplies ``l1_scale``."""
    if select.cuda_train_supported(x, w_gate.shape[0], w_down.shape[0]):
        return _cuda_train().ffn_train_backward(dy, x, w_gate, b_gate, w_up, b_up, w_down, *state, l1_scale,
                                                act, l1_coef)
    return torch_impl.ffn_train_backward(dy, x, w_gate, b_gate, w_up, b_up, w_down, *state, l1_scale, act, l1_coef)


def reset() -> None:
    """Forget every op instance's runtime state (density measurements, the training path's
    hints); ``torch._dynamo.reset()`` calls this through the backend."""
    density.reset()
    _plans.clear()
    train = sys.modules.get("twell_compile.runtime.cuda_train")
    if train is not None:
        train.clear_hints()

