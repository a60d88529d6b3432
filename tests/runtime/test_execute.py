"""runtime/execute.py: what a call tells the user (no GPU needed)."""

from __future__ import annotations

import logging

import torch

import twell_compile  # noqa: F401  (registers the ops)
from twell_compile.runtime import execute


def _args(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=g).to(dtype)
    wg, wu = (torch.randn(16, 8, generator=g) / 3).to(dtype), (torch.randn(16, 8, generator=g) / 3).to(dtype)
    wd = (torch.randn(8, 16, generator=g) / 4).to(dtype)
    return x, wg, None, wu, None, wd, None


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
