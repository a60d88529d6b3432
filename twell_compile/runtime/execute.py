"""Runs an op call: reads its cached plan (or asks ``select`` for one), then calls the plan's
launcher.

    ffn_infer            twell::ffn            cached plan -> cuda_infer / cuda_decode / cpu_ffn / torch_impl
    ffn_train_forward    twell::ffn_train      plan_train -> cuda_train / torch_impl
    ffn_train_backward   twell::ffn_train_bwd  the path the saved state's shapes say
    experts_*            twell::experts*       the above once per expert, on its rows

The experts functions run a mixture-of-experts block's expert FFNs on rows already grouped by
expert (``offs``: each expert's cumulative end row, as ``torch._grouped_mm`` takes it; one
host read per call). Expert ``e`` is the layer ``{layer}.{e}`` (its own density state and
``layer_stats`` row); rows past ``offs[-1]`` get zeros.

Every call runs inside its op instance's scope (density.enter), so the measurements it reads
and writes are its own op's. Inference plans are cached per op instance, layer, device, dtype,
shapes, flags and path: a call reads its plan, takes a landed density measurement if one is
pending, and decides only whether to probe this call (the plan's interval); a landed
measurement (the layer state's version), ``density.reset``, ``arch.patched``, a change of
deterministic mode or of ``decode_graphs.enabled`` makes a new plan. Under CUDA-graph capture
plans are made afresh (nothing is probed there). No host sync on any path: decisions use
shapes, dtypes, devices and lagged device-side counts only. The CUDA launchers import Triton,
so they are imported on first use (``import twell_compile.ops`` stays light on machines without it).
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from twell_compile import control
from twell_compile.formats import ell_width_for
from twell_compile.runtime import arch, decode_graphs, density, select, torch_impl

log = logging.getLogger("twell_compile")
_warned_fp16_l1 = False
MAX_PLANS = 4096                   # cached inference plans (cleared past this: a token count per call)
_plans: dict[tuple, tuple] = {}    # cache key -> (plan, its layer state or None, the state's version)


def infer_plan(x: Tensor, n: int, k_out: int, gated: bool, layer: str, instance: int,
               path: str) -> select.InferPlan:
    """The call's plan: the cached one while its layer's density state has not moved and this
    call is not due to probe (the plan's interval); else select.plan_infer's, cached when it
    probes nothing. Statistics do not change the plan: the launchers take them on any path."""
    ck = (instance, layer, x.device, x.dtype, x.shape, n, k_out, gated, path,
          torch.are_deterministic_algorithms_enabled(), decode_graphs.ENABLED, arch.generation,
          density.generation)
    capturing = x.is_cuda and density.capturing()
    hit = _plans.get(ck)
    if hit is not None and not capturing:
        plan, st, version = hit
        if st is None:
            return plan
        density.take_landed(st)
        if st.version == version and not density.due(st, plan.every):
            return plan
    plan = select.plan_infer(x, n, k_out, gated, layer, path)
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
        plan = infer_plan(x, n, k_out, w_up is not None, layer, instance, path)
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
            *out, gate_counts = torch_impl.ffn_train_forward(x, w_gate, b_gate, w_up, b_up, w_down, b_down,
                                                             ell_width, backup_rows, layer, keep_stats, act)
            return (*out, _coef(gate_counts, n, layer, l1_control))
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
    coef = control.on_call(layer, counts.sum(dtype=torch.float64), counts.numel(), n)
    return coef if coef is not None else counts.new_zeros((1,), dtype=torch.float32)


def ffn_train_backward(dy: Tensor, x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor],
                       w_up: Optional[Tensor], b_up: Optional[Tensor], w_down: Tensor, *state: Tensor,
                       l1_scale: float, l1_coef: Optional[Tensor] = None, act: str = "relu",
                       db_down: bool = True) -> tuple[Optional[Tensor], ...]:
    """Gradients (dx, dw_gate, db_gate, dw_up, db_up, dw_down, db_down) from the saved state:
    the CUDA backward where the CUDA training kernels take the call (its path follows the
    state's shapes), plain PyTorch otherwise. ``l1_coef`` ([1] device tensor, or None)
    multiplies ``l1_scale``. ``db_down`` False: db_down is None (no bias: no pass over dy)."""
    if select.cuda_train_supported(x, w_gate.shape[0], w_down.shape[0]):
        return _cuda_train().ffn_train_backward(dy, x, w_gate, b_gate, w_up, b_up, w_down, *state, l1_scale,
                                                act, l1_coef, db_down)
    return torch_impl.ffn_train_backward(dy, x, w_gate, b_gate, w_up, b_up, w_down, *state, l1_scale, act, l1_coef,
                                         db_down)


def expert_rows(offs: Tensor, rows: int) -> list[tuple[int, int]]:
    """Each expert's row range [start, stop) from the cumulative ends ``offs`` (one host read)."""
    if offs.dim() != 1 or offs.is_floating_point() or offs.is_complex():
        raise ValueError(f"offs must be a 1-D integer tensor, got {offs.dtype} {tuple(offs.shape)}")
    out, start = [], 0
    for end in offs.tolist():
        if end < start or end > rows:
            raise ValueError(f"offs must be non-decreasing ends within x's {rows} rows, got {offs.tolist()}")
        out.append((start, end))
        start = end
    return out


def _expert(w: Optional[Tensor], e: int) -> Optional[Tensor]:
    return None if w is None else w[e]


def experts_infer(x: Tensor, w_gate: Tensor, w_up: Optional[Tensor], w_down: Tensor, offs: Tensor, layer: str,
                  keep_stats: bool, instance: int = 0, path: str = "auto", act: str = "relu") -> Tensor:
    """y [S, K_out] for x [S, K] grouped by expert: expert e's FFN (w_gate[e], w_up[e],
    w_down[e]) on rows offs[e-1]:offs[e], by ``ffn_infer``."""
    y = x.new_zeros((x.shape[0], w_down.shape[1]))
    for e, (a, b) in enumerate(expert_rows(offs, x.shape[0])):
        if a < b:
            y[a:b] = ffn_infer(x[a:b], w_gate[e], None, _expert(w_up, e), None, w_down[e], None, f"{layer}.{e}",
                               keep_stats, instance, path, act)
    return y


def experts_train_forward(x: Tensor, w_gate: Tensor, w_up: Optional[Tensor], w_down: Tensor, offs: Tensor,
                          ell_width: int, backup_rows: int, layer: str, keep_stats: bool, instance: int = 0,
                          path: str = "auto", l1_scale: float = 0.0, act: str = "relu") -> tuple[Tensor, ...]:
    """(y, counts, cols, ell_g, ell_u, backup_idx, backup_g, backup_u, backup_offs): each
    expert's ``ffn_train_forward`` state concatenated by rows (the per-row tensors cover all S
    rows, zero past offs[-1]; the backup's rows are expert after expert, ``backup_offs`` [E]
    int64 their cumulative ends, ``backup_idx`` local to each expert's rows)."""
    m, n = x.shape[0], w_gate.shape[1]
    y = x.new_zeros((m, w_down.shape[1]))
    width = ell_width_for(ell_width, n)
    counts = x.new_zeros((m,), dtype=torch.int32)
    cols = x.new_zeros((m, width), dtype=torch.int32)
    ell_g = x.new_zeros((m, width))
    ell_u = x.new_zeros((m, width if w_up is not None else 0))
    backup: list[tuple[Tensor, Tensor, Tensor]] = []
    ends: list[int] = []
    for e, (a, b) in enumerate(expert_rows(offs, m)):
        if a < b:
            out = ffn_train_forward(x[a:b], w_gate[e], None, _expert(w_up, e), None, w_down[e], None, ell_width,
                                    backup_rows, f"{layer}.{e}", keep_stats, instance, path, l1_scale, act)
            y[a:b], counts[a:b], cols[a:b], ell_g[a:b], ell_u[a:b] = out[:5]
            backup.append(out[5:8])
        ends.append(sum(int(t[0].shape[0]) for t in backup))
    idx = torch.cat([t[0] for t in backup]) if backup else x.new_zeros((0,), dtype=torch.int64)
    bg = torch.cat([t[1] for t in backup]) if backup else x.new_zeros((0, n))
    bu = torch.cat([t[2] for t in backup]) if backup else x.new_zeros((0, n if w_up is not None else 0))
    return y, counts, cols, ell_g, ell_u, idx, bg, bu, torch.tensor(ends, dtype=torch.int64, device=x.device)


def experts_train_backward(dy: Tensor, x: Tensor, w_gate: Tensor, w_up: Optional[Tensor], w_down: Tensor,
                           offs: Tensor, counts: Tensor, cols: Tensor, ell_g: Tensor, ell_u: Tensor,
                           backup_idx: Tensor, backup_g: Tensor, backup_u: Tensor, backup_offs: Tensor,
                           l1_scale: float, act: str = "relu") -> tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
    """(dx, dw_gate, dw_up, dw_down) from ``experts_train_forward``'s state, expert by expert
    (``ffn_train_backward``). The L1 term is the mean of |h| over every routed row: expert e's
    share of ``l1_scale`` is its rows over all routed rows."""
    dx = torch.zeros_like(x)
    dwg, dwd = torch.zeros_like(w_gate), torch.zeros_like(w_down)
    dwu = torch.zeros_like(w_up) if w_up is not None else None
    rows = expert_rows(offs, x.shape[0])
    kept = expert_rows(backup_offs, backup_idx.shape[0])
    routed = max(rows[-1][1] if rows else 0, 1)
    for e, ((a, b), (c, d)) in enumerate(zip(rows, kept)):
        if a == b:
            continue
        g = ffn_train_backward(dy[a:b], x[a:b], w_gate[e], None, _expert(w_up, e), None, w_down[e], counts[a:b],
                               cols[a:b], ell_g[a:b], ell_u[a:b], backup_idx[c:d], backup_g[c:d], backup_u[c:d],
                               l1_scale=l1_scale * (b - a) / routed, act=act, db_down=False)
        dx[a:b], dwg[e], dwd[e] = g[0], g[1], g[5]
        if dwu is not None:
            dwu[e] = g[3]
    return dx, dwg, dwu, dwd


def reset_warnings() -> None:
    """Let the warnings a process gives once (the float16 L1 one) be given once more."""
    global _warned_fp16_l1
    _warned_fp16_l1 = False


def reset() -> None:
    """Forget every op instance's runtime state (density measurements, the training path's
    hints); ``torch._dynamo.reset()`` calls this through the backend."""
    density.reset()
    _plans.clear()
    train = sys.modules.get("twell_compile.runtime.cuda_train")
    if train is not None:
        train.clear_hints()

