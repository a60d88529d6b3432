"""runtime/execute.py: what a call tells the user (no GPU needed)."""

from __future__ import annotations

import logging

import torch

import twell_compile  # noqa: F401  (registers the ops)
from twell_compile.runtime import execute
from twell_compile.testing import make_ffn


def _args(dtype):
    p = make_ffn(6, 8, 16, 0.3, dtype=dtype, device="cpu")
    return tuple(p[k] for k in ("x", "w_gate", "b_gate", "w_up", "b_up", "w_down", "b_down"))


def test_l1_in_float16_warns_once_about_loss_scaling(monkeypatch, caplog):
    monkeypatch.setattr(execute, "_warned_fp16_l1", False)
    with caplog.at_level(logging.WARNING, logger="twell_compile"):
        torch.ops.twell.ffn_train(*_args(torch.bfloat16), 4, 2, 0.5, "bf", False)     # bf16: silent
        torch.ops.twell.ffn_train(*_args(torch.float16), 4, 2, 0.0, "fp", False)      # no penalty: silent
        assert not [r for r in caplog.records if "GradScaler" in r.getMessage()]
        for _ in range(2):
            torch.ops.twell.ffn_train(*_args(torch.float16), 4, 2, 0.5, "fp", False)
    hits = [r for r in caplog.records if "GradScaler" in r.getMessage()]
    assert len(hits) == 1 and "bfloat16" in hits[0].getMessage()
