"""Helpers shared by the GPU benchmarks: the results folder's GPU tag, relative error, and
do_bench medians (CUDA events)."""

from __future__ import annotations

from typing import Callable, Optional

import torch


def gpu_name() -> str:
    """Short tag of the current CUDA device for benchmarks/results/<tag>/ ("h200", "h100", ...)."""
    name = torch.cuda.get_device_name().lower()
    for tag in ("h200", "h100", "a100", "l40", "l4", "b200"):
        if tag in name:
            return tag
    return name.replace(" ", "_")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def median_ms(fn: Callable[[], object], reps: int, warmup: Optional[int] = None) -> float:
    """Median ms of ``fn`` by triton.testing.do_bench (rep ``reps`` ms; warm-up reps // 4, >= 10)."""
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=max(10, reps // 4) if warmup is None else warmup, rep=reps,
                          return_mode="median"))
