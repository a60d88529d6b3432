"""The controller behind ``twell.target_density``: per-layer L1 coefficients adapted on the device.

Each controlled FFN layer (keyed by its layer name, like the statistics) keeps on its device:

    log_coef [1] fp64   log of the layer's coefficient, in ``twell.l1``'s units
    coef     [1] fp32   exp(log_coef): what the layer's backward multiplies its penalty by
    acc      [2] fp64   non-zeros and slots (tokens x hidden units) of the calls of this step
    level    [1] fp64   the measured log density, averaged over about SMOOTH_TOKENS tokens
    held     [1] bool   whether the layer is held (near its target) or still walked down

A training call (``twell::ffn_train``'s forward) adds its non-zero count to ``acc`` and hands
its backward ``coef / k`` (a fresh [1] tensor; ``k`` = the layer's calls in the previous
optimizer step), so k accumulated micro-batches add up to one step's penalty, as a loss divided
by k does. The first call after an optimizer step (any ``torch.optim`` optimizer, counted by a
global step post-hook; or ``step()``) closes the step: its counts are all-reduced over the
ranks of the default process group (asynchronously; NCCL's wait only orders streams), and the
previous step's reduced counts, waited for now, move the coefficient.

The level is the measured log density averaged over steps with weight 1 - exp(-tokens /
SMOOTH_TOKENS) for a step of ``tokens`` tokens (all ranks'): a per-step density of a few hundred
tokens is noisy, one of 16k is not, and an average is a lag the loop pays for. With e = level -
log target and e' the previous update's e, the step has two regimes:

    walking  (a layer that starts over START from the target, until its level first comes
             within NEAR of it):
             GAIN * ((e - e') + clamp(e / HORIZON, -PACE, PACE))
    held     (from then on):
             KP * (clamp(e) - clamp(e')) + KI * clamp(e)            clamp: to +-E_MAX
    log_coef = clamp(log_coef + clamp(step, -MAX_DOWN, MAX_UP), LOG_MIN, LOG_MAX)

Walking is for a dense start: the step pushes while the density closes in slower than the pace
(at most PACE a step, slower near the target) and backs off while it closes in faster, so a
density falling fast stops the push before it arrives. A density driven under its target is not
brought back by backing off (ReLU units that stop firing get no gradient, and a small model's
layer stays sparse with no penalty at all): the walk must not overshoot. Held is a
proportional-integral step that keeps a layer at its target while what the density needs moves
with training. Its gains are the internal-model (lambda) tuning of a plant of gain -3 (twice the
coefficient, an eighth of the density), a fall time of 3 optimizer steps, a rise time of 10 and
2 steps of delay, on top of the rule's own step of lag (tests/test_control.py's _fast_plant),
near the best fits to the layers of a 4-layer H200 run (results/h200/e2e_train_target.json,
``benchmarks/probes/controller_fit.py --fit``: gains of -3 to -5, fall times of 2-6 steps, rise
times of 12-16, delays of 1-2 for three layers; the fourth's gain -0.5). There the
walking rule alone, on a density smoothed over 10 steps, swung every layer 0.13-1.1% around a
0.5% target. The step is bounded per optimizer step (MAX_UP, MAX_DOWN).
Every rank applies the same function to the same all-reduced sums (exact: integer counts in
fp64), so ranks hold bit-identical coefficients. One step of lag (the update uses the step
before the one just closed) hides the all-reduce entirely, and a single process follows the
same trajectory. No host sync anywhere: shapes and call counts are host integers, everything
else stays on the device.

With ``target_steps`` S, the target moves geometrically from the layer's first measured
density to the requested one over S updates. Until the first optimizer step is seen in the
process, every training call counts as a step (an optimizer outside ``torch.optim``: call
``twell_compile.controller_step()`` after each step).

``state_dict`` / ``load_state_dict`` carry every layer's state through a checkpoint (tensors
on the CPU; they move to the layer's device at its next call).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

GAIN = 2.0              # walking: log-coefficient step per unit of (velocity error) below
HORIZON = 100.0         # walking: optimizer steps over which the remaining log error is asked to close
PACE = 0.02             # walking: the fastest the log density is asked to move toward the target per step
START = 0.5             # a layer that starts within this of the log target (1.65x) is held from the start
NEAR = 0.15             # else walking ends once the level comes within this of the log target (1.16x)
KP = 0.3                # held: log-coefficient step per unit change of the log-density error
KI = 0.05               # held: log-coefficient step per unit of log-density error, each optimizer step
E_MAX = 1.0             # held: the error's bound (a density 2.7x off asks no more than that)
SMOOTH_TOKENS = 2560.0  # the level averages about this many tokens' densities (0.1 per 256-token step)
MAX_UP = 0.08           # at most x1.083 per optimizer step
MAX_DOWN = 0.15         # at most /1.16 per optimizer step (backing off beats pushing)
FLOOR = 1e-6            # density floor inside the log (a layer with no non-zeros)
COEF_INIT = 0.5         # starting coefficient, in twell.l1's units (under any that sparsifies)
LOG_MIN, LOG_MAX = math.log(1e-6), math.log(1e6)

_lock = threading.Lock()
_steps = 0              # optimizer steps seen in this process (hook, or step())
_hooked = False


@dataclass
class LayerControl:
    """One layer's controller state (host bookkeeping; tensors on the layer's device)."""

    target: float
    steps: int
    log_coef: Tensor
    coef: Tensor
    acc: Tensor
    start: Tensor                    # log of the first measured density (the schedule's start)
    level: Tensor                    # [1] fp64: the measured log density, averaged (SMOOTH_TOKENS)
    held: Tensor                     # [1] bool: the level has come within NEAR of the target
    err: Tensor                      # [1] fp64: the previous update's err (level - log target)
    slots: int = 0                   # tokens x hidden units of this step's calls
    hidden: int = 1                  # the layer's hidden units (slots per token)
    calls: int = 0                   # training calls of this step
    per_call: int = 1                # calls of the last complete step (k)
    updates: int = 0                 # updates applied (the schedule's progress)
    seen: Optional[int] = None       # optimizer steps seen at the latest call
    pending: Optional[Tensor] = None  # the closed step's counts, being all-reduced
    work: Any = field(default=None, repr=False)


def _new(device: torch.device, target: float, steps: int, init: float) -> LayerControl:
    with torch.inference_mode(False):
        log_coef = torch.full((1,), math.log(init or COEF_INIT), dtype=torch.float64, device=device)
        zero = torch.zeros(1, dtype=torch.float64, device=device)
        return LayerControl(target, steps, log_coef, log_coef.exp().float(),
                            torch.zeros(2, dtype=torch.float64, device=device), zero, zero.clone(),
                            torch.zeros(1, dtype=torch.bool, device=device), zero.clone())


_layers: dict[str, LayerControl] = {}


def _count_step(*_args: Any) -> None:
    global _steps
    _steps += 1


def step() -> None:
    """Mark an optimizer step (for optimizers outside ``torch.optim``, whose steps the global
    post-hook does not see); a controlled layer's next call closes its step."""
    _count_step()


def _hook() -> None:
    global _hooked
    if not _hooked:
        with _lock:
            if not _hooked:
                from torch.optim.optimizer import register_optimizer_step_post_hook

                register_optimizer_step_post_hook(_count_step)
                _hooked = True


def configure(layer: str, target: float, steps: int, init: float = 0.0) -> None:
    """Declare ``layer`` controlled toward ``target``, starting from coefficient ``init`` (0:
    COEF_INIT). A layer already controlled keeps its coefficient: a recompile or a second
    prepare goes on from where the layer is."""
    _hook()
    with _lock:
        st = _layers.get(layer)
        if st is None:
            _layers[layer] = _new(torch.device("cpu"), target, steps, init)
        else:
            st.target, st.steps = target, steps


def target_of(layer: str) -> Optional[float]:
    st = _layers.get(layer)
    return None if st is None else st.target


def update_rule(log_coef: Tensor, err: Tensor, err_prev: Tensor, held: Tensor) -> Tensor:
    """The next log coefficient (device tensors, no sync) from ``err`` = level - log target, the
    previous update's ``err_prev``, and whether the layer is ``held`` (module docstring)."""
    walk = GAIN * ((err - err_prev) + (err / HORIZON).clamp(-PACE, PACE))
    e, e_prev = err.clamp(-E_MAX, E_MAX), err_prev.clamp(-E_MAX, E_MAX)
    hold = KP * (e - e_prev) + KI * e
    step = torch.where(held, hold, walk)
    return (log_coef + step.clamp(-MAX_DOWN, MAX_UP)).clamp(LOG_MIN, LOG_MAX)


def _to(st: LayerControl, device: torch.device) -> None:
    if st.acc.device != device:
        if st.work is not None:
            st.work.wait()
            st.work = None
        for name in ("log_coef", "coef", "acc", "start", "level", "held", "err", "pending"):
            t = getattr(st, name)
            if t is not None:
                setattr(st, name, t.to(device))


def _all_reduce(t: Tensor) -> Any:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.all_reduce(t, async_op=True)
    return None


def _apply(st: LayerControl, counts: Tensor) -> None:
    """Move the coefficient by one step from all-reduced [non-zeros, slots]."""
    nnz, slots = counts[0:1], counts[1:2]
    measured = slots > 0
    log_d = torch.log((nnz / slots.clamp(min=1.0)).clamp(min=FLOOR))
    first = st.updates == 0
    log_t = math.log(st.target)
    if first:
        st.start.copy_(log_d)
    # the level: this step's log density, averaged with the earlier ones by the tokens it saw
    # (all ranks' together: slots / hidden, on the device)
    weight = -torch.expm1(-(slots / (st.hidden * SMOOTH_TOKENS)))
    level = torch.where(measured, log_d if first else st.level + weight * (log_d - st.level), st.level)
    if st.steps:
        frac = min(1.0, (st.updates + 1) / st.steps)
        goal = st.start.clamp(min=log_t) * (1.0 - frac) + log_t * frac
    else:
        goal = torch.full_like(st.start, log_t)
    err = level - goal
    # held from the start when the first level is within START of the goal; else walked down
    # until it comes within NEAR, and held from then on
    held = st.held | (measured & (err.abs() < (START if first else NEAR)))
    new = update_rule(st.log_coef, err, err if first else st.err, held)
    st.log_coef.copy_(torch.where(measured, new, st.log_coef))
    st.coef.copy_(st.log_coef.exp())
    st.level.copy_(level)
    st.held.copy_(held)
    st.err.copy_(torch.where(measured, err, st.err))
    st.updates += 1


def _close_step(st: LayerControl) -> None:
    st.acc[1].fill_(float(st.slots))
    work = _all_reduce(st.acc)
    if st.pending is not None:
        if st.work is not None:
            st.work.wait()
        _apply(st, st.pending)
    st.pending, st.work = st.acc, work
    st.acc = torch.zeros_like(st.pending)
    st.per_call = max(st.calls, 1)
    st.calls, st.slots = 0, 0


def on_call(layer: str, nnz: Tensor, tokens: int, hidden: int) -> Optional[Tensor]:
    """A training call of ``layer``: count its non-zeros (``nnz``, a 0-d device tensor) over
    ``tokens`` x ``hidden`` units; return the coefficient its backward applies ([1] fp32, a
    fresh tensor), or None when the layer is not controlled."""
    st = _layers.get(layer)
    if st is None:
        return None
    with torch.inference_mode(False):
        _to(st, nnz.device)
        if st.calls and (_steps == 0 or st.seen != _steps):
            _close_step(st)
        st.seen = _steps
        st.acc[0:1].add_(nnz.to(torch.float64))
        st.slots += tokens * hidden
        st.hidden = hidden
        st.calls += 1
        return st.coef * (1.0 / st.per_call)


def coefficient(layer: str) -> Optional[Tensor]:
    """The layer's coefficient ([1] fp32 on its device, twell.l1's units), or None."""
    st = _layers.get(layer)
    return None if st is None else st.coef


def layers() -> list[str]:
    return sorted(_layers)


def state_dict() -> dict[str, dict[str, Any]]:
    """Every controlled layer's state, tensors copied to the CPU (a host sync: for checkpoints)."""
    out = {}
    with _lock:
        for layer, st in sorted(_layers.items()):
            if st.work is not None:
                st.work.wait()
                st.work = None
            out[layer] = {
                "target": st.target, "steps": st.steps, "log_coef": st.log_coef.cpu(), "acc": st.acc.cpu(),
                "start": st.start.cpu(), "level": st.level.cpu(), "held": st.held.cpu(), "err": st.err.cpu(),
                "slots": st.slots, "hidden": st.hidden, "calls": st.calls, "per_call": st.per_call,
                "updates": st.updates, "pending": None if st.pending is None else st.pending.cpu(),
            }
    return out


def load_state_dict(state: dict[str, dict[str, Any]]) -> None:
    """Restore what ``state_dict`` returned: each named layer's coefficient, statistics and
    schedule progress (the target comes from the options the model is compiled or prepared
    with, when they name the layer). The first call after loading closes the saved step."""
    if not isinstance(state, dict):
        raise TypeError(f"load_controller_state_dict takes the dict controller_state_dict returned, got "
                        f"{type(state).__name__}")
    _hook()
    with _lock:
        for layer, s in state.items():
            try:
                log_coef = s["log_coef"].to(torch.float64).reshape(1)
                # a state saved before the held regime: its smoothed log density is the level, and
                # the layer is held when that is within NEAR of its target (as the latch would be)
                level = (s["level"] if "level" in s else s["smooth"]).to(torch.float64).reshape(1)
                held = (s["held"].to(torch.bool) if "held" in s
                        else (level - math.log(float(s["target"]))).abs() < NEAR)
                st = LayerControl(float(s["target"]), int(s["steps"]), log_coef.clone(),
                                  log_coef.exp().float(), s["acc"].to(torch.float64).clone(),
                                  s["start"].to(torch.float64).clone(), level.clone(),
                                  held.clone(), s["err"].to(torch.float64).clone(),
                                  slots=int(s["slots"]), hidden=int(s.get("hidden", 1)), calls=int(s["calls"]),
                                  per_call=int(s["per_call"]), updates=int(s["updates"]),
                                  pending=None if s["pending"] is None else s["pending"].to(torch.float64).clone())
            except (KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"load_controller_state_dict: layer {layer!r}: not a state saved by "
                                 f"controller_state_dict ({type(e).__name__}: {e})") from None
            old = _layers.get(layer)
            if old is not None:        # the options in force keep their target
                st.target, st.steps = old.target, old.steps
            _layers[layer] = st


def reset() -> None:
    """Forget every layer's controller state (a new training run from the same process)."""
    with _lock:
        _layers.clear()
