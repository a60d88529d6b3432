"""The controller behind ``twell.target_density``: per-layer L1 coefficients adapted on the device.

Each controlled FFN layer (keyed by its layer name, like the statistics) keeps on its device:

    log_coef [1] fp64   log of the layer's coefficient, in ``twell.l1``'s units
    coef     [1] fp32   exp(log_coef): what the layer's backward multiplies its penalty by
    acc      [2] fp64   non-zeros and slots (tokens x hidden units) of the calls of this step

A training call (``twell::ffn_train``'s forward) adds its non-zero count to ``acc`` and hands
its backward ``coef / k`` (a fresh [1] tensor; ``k`` = the layer's calls in the previous
optimizer step), so k accumulated micro-batches add up to one step's penalty, as a loss divided
by k does. The first call after an optimizer step (any ``torch.optim`` optimizer, counted by a
global step post-hook; or ``step()``) closes the step: its counts are all-reduced over the
ranks of the default process group (asynchronously; NCCL's wait only orders streams), and the
previous step's reduced counts, waited for now, move the coefficient. With e = the smoothed
log(density / target) (an EMA over steps) and e' its value at the previous update:

    pace     = clamp(e / HORIZON, -PACE, PACE)          how fast the density should close in
    log_coef = clamp(log_coef + clamp(GAIN * ((e - e') + pace), -MAX_DOWN, MAX_UP), LOG_MIN, LOG_MAX)

a multiplicative step that pushes while the density closes in slower than ``pace`` and backs
off while it closes in faster: far above the target the density is walked down at most PACE
(2%) per step, slowing as it nears the target, and a density falling fast stops the push
before it arrives. The density lags the coefficient by tens of optimizer steps and, once a
layer is sparse, stays sparse with far less penalty (ReLU units that stop firing get no
gradient), so a density driven under the target is not brought back by backing off: the push
has to end before the target is reached. The step is bounded per optimizer step (MAX_UP,
MAX_DOWN). Every rank applies the same function to the same all-reduced sums (exact: integer counts in fp64), so
ranks hold bit-identical coefficients. One step of lag (the update uses the step before the
one just closed) hides the all-reduce entirely, and a single process follows the same
trajectory. No host sync anywhere: shapes and call counts are host integers, everything else
stays on the device.

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

GAIN = 2.0              # log-coefficient step per unit of (velocity error) below
HORIZON = 100.0         # optimizer steps over which the remaining log error is asked to close
PACE = 0.02             # the fastest the log density is asked to move toward the target per step
SMOOTH = 0.1            # weight of the newest step in the smoothed log density
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
    smooth: Tensor                   # [1] fp64: smoothed log density
    err: Tensor                      # [1] fp64: the previous update's err (smooth - log target)
    slots: int = 0                   # tokens x hidden units of this step's calls
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
                            torch.zeros(2, dtype=torch.float64, device=device), zero, zero.clone(), zero.clone())


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


def update_rule(log_coef: Tensor, err: Tensor, err_prev: Tensor) -> Tensor:
    """The next log coefficient (device tensors, no sync) from the smoothed log error ``err`` =
    log(density / target) and the previous update's ``err_prev`` (module docstring)."""
    pace = (err / HORIZON).clamp(-PACE, PACE)
    step = GAIN * ((err - err_prev) + pace)
    return (log_coef + step.clamp(-MAX_DOWN, MAX_UP)).clamp(LOG_MIN, LOG_MAX)


def _to(st: LayerControl, device: torch.device) -> None:
    if st.acc.device != device:
        if st.work is not None:
            st.work.wait()
            st.work = None
        for name in ("log_coef", "coef", "acc", "start", "smooth", "err", "pending"):
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
    if first:
        st.start.copy_(log_d)
    smooth = torch.where(measured, log_d if first else st.smooth + SMOOTH * (log_d - st.smooth), st.smooth)
    log_t = math.log(st.target)
    if st.steps:
        frac = min(1.0, (st.updates + 1) / st.steps)
        log_target = st.start.clamp(min=log_t) * (1.0 - frac) + log_t * frac
    else:
        log_target = torch.full_like(st.start, log_t)
    err = smooth - log_target
    new = update_rule(st.log_coef, err, err if first else st.err)
    st.log_coef.copy_(torch.where(measured, new, st.log_coef))
    st.coef.copy_(st.log_coef.exp())
    st.smooth.copy_(smooth)
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


def on_call(layer: str, nnz: Tensor, slots: int) -> Optional[Tensor]:
    """A training call of ``layer``: count its non-zeros (``nnz``, a 0-d device tensor) over
    ``slots`` = tokens x hidden units; return the coefficient its backward applies ([1] fp32,
    a fresh tensor), or None when the layer is not controlled."""
    st = _layers.get(layer)
    if st is None:
        return None
    with torch.inference_mode(False):
        _to(st, nnz.device)
        if st.calls and (_steps == 0 or st.seen != _steps):
            _close_step(st)
        st.seen = _steps
        st.acc[0:1].add_(nnz.to(torch.float64))
        st.slots += slots
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
                "start": st.start.cpu(), "smooth": st.smooth.cpu(), "err": st.err.cpu(), "slots": st.slots, "calls": st.calls, "per_call": st.per_call,
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
                st = LayerControl(float(s["target"]), int(s["steps"]), log_coef.clone(),
                                  log_coef.exp().float(), s["acc"].to(torch.float64).clone(),
                                  s["start"].to(torch.float64).clone(), s["smooth"].to(torch.float64).clone(),
                                  s["err"].to(torch.float64).clone(), int(s["slots"]), int(s["calls"]),
                                  int(s["per_call"]), int(s["updates"]), None,
                                  None if s["pending"] is None else s["pending"].to(torch.float64).clone())
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
