"""runtime/execute.py: what a call tells the user, and its cached plans (GPU tests marked)."""

from __future__ import annotations

import logging

import pytest

import torch

import twell_compile  # noqa: F401  (registers the ops)
from twell_compile.runtime import execute
from twell_compile.testing import make_ffn


def _args(dtype):
    p = make_ffn(6, 8, 16, 0.3, dtype=dtype, device="cpu")
    return tuple(p[k] for k in ("x", "w_gate", "b_gate", "w_up", "b_up", "w_down", "b_down"))


def test_l1_in_float16_warns_once_about_loss_scaling(caplog):
    execute.reset_warnings()
    with caplog.at_level(logging.WARNING, logger="twell_compile"):
        torch.ops.twell.ffn_train(*_args(torch.bfloat16), 4, 2, 0.5, "bf", False)     # bf16: silent
        torch.ops.twell.ffn_train(*_args(torch.float16), 4, 2, 0.0, "fp", False)      # no penalty: silent
        assert not [r for r in caplog.records if "GradScaler" in r.getMessage()]
        for _ in range(2):
            torch.ops.twell.ffn_train(*_args(torch.float16), 4, 2, 0.5, "fp", False)
    hits = [r for r in caplog.records if "GradScaler" in r.getMessage()]
    assert len(hits) == 1 and "bfloat16" in hits[0].getMessage()


def test_cpu_plans_are_cached_per_shape_and_follow_patches():
    """A call reads its cached plan; a record patch, the graphs' switch or density.reset makes a
    new one."""
    from twell_compile.runtime import arch, decode_graphs, density, execute

    x = torch.randn(3, 16)
    execute.reset()
    first = execute.infer_plan(x, 40, 16, True, "cache", 0, "auto")
    assert execute.infer_plan(x, 40, 16, True, "cache", 0, "auto") is first
    assert execute.infer_plan(torch.randn(5, 16), 40, 16, True, "cache", 0, "auto") is not first
    with decode_graphs.enabled(not decode_graphs.ENABLED):
        assert execute.infer_plan(x, 40, 16, True, "cache", 0, "auto") is not first
    assert execute.infer_plan(x, 40, 16, True, "cache", 0, "auto") is first
    with arch.patched(min_width=8):
        patched = execute.infer_plan(x, 40, 16, True, "cache", 0, "auto")
        assert patched is not first and patched.path in ("cpu", "torch")
    density.reset()
    assert execute.infer_plan(x, 40, 16, True, "cache", 0, "auto") is not first


@pytest.mark.gpu
def test_cuda_plans_are_reused_until_a_measurement_lands_and_probe_on_their_interval():
    from twell_compile.runtime import arch, density, execute

    x = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
    execute.reset()
    with arch.patched(min_tokens=1024, min_width=1, refresh_every=4, probe_every=4):
        with density.scope(7):
            plans = []
            for _ in range(10):
                plan = execute.infer_plan(x, 1000, 256, True, "cache", 7, "auto")
                plans.append(plan)
                if plan.probe:                       # as execute does: a measurement in flight
                    density.submit(plan.key, torch.tensor(5.0, device="cuda"), 4096 * 1000)
                density.tick(plan.key, plan.path)
            torch.cuda.synchronize()
            assert plans[0].probe                    # the first call measures
            assert not any(p.probe for p in plans[1:4])
            landed = execute.infer_plan(x, 1000, 256, True, "cache", 7, "auto")
            assert density.measured(plans[0].key) is not None
            assert landed is not plans[1]            # a landed measurement: a new plan
            again = execute.infer_plan(x, 1000, 256, True, "cache", 7, "auto")
            assert again is landed or again.probe
