"""Helpers shared by the GPU benchmarks: the GPU's folder tag, relative error, do_bench
medians (CUDA events), peak memory, a training point's inputs, and --policy FIELD=VALUE changes
to the GPU record. The rows they write: benchmarks/rows.py."""

from __future__ import annotations

import time
from typing import Callable, Mapping, Optional

import torch


def gpu_name() -> str:
    """Short tag of the current CUDA device ("h200", "h100", ...): the folder under runs/ (and
    benchmarks/results/) its results go to."""
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


def interleaved_ms(fns: Mapping[str, Callable[[], object]], reps: int, rounds: int = 5) -> dict[str, float]:
    """Median ms per variant over ``rounds`` rounds; each round times every variant once
    (do_bench, rep ``reps // rounds`` ms), starting one variant later each round. Timed one
    after the other instead, the same dense call read 5-24% apart at K=4096 (H200, 2026-11-23:
    the op's dense path 6.53 vs eager 6.47 ms interleaved, 0.86-0.95x in the grid's order)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(fns)
    got: dict[str, list[float]] = {name: [] for name in names}
    rep = max(10, reps // rounds)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            got[name].append(median_ms(fns[name], rep))
    return {name: sorted(v)[len(v) // 2] for name, v in got.items()}


def policy_changes(pairs) -> dict:
    """--policy FIELD=VALUE pairs as arch.patched's keyword arguments, each value in the type
    of the record's field ("wg_chunk=256" -> {"wg_chunk": 256})."""
    from twell_compile.runtime import arch
    out = {}
    for kv in pairs:
        field, sep, value = kv.partition("=")
        if not sep or not hasattr(arch.H200, field):
            raise ValueError(f"--policy {kv!r}: expected FIELD=VALUE with FIELD a GpuPolicy field")
        out[field] = type(getattr(arch.H200, field))(value)
    return out


def bench(fn, reps: int, cuda: bool) -> float:
    """ms of ``fn``: median_ms on CUDA, else the median of three wall-clock calls after one."""
    if cuda:
        return median_ms(fn, reps)
    fn()
    t = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return sorted(t)[1] * 1e3

def train_inputs(m: int, k: int, n: int, d: float, t: float, seed: int, dev, dt, activity: str = "iid"):
    """x, w_gate, w_up, w_down (leaves requiring grad) and dy of one point (the reference's
    child, benchmarks/reference.py --train, builds the same from the same seed); ``activity``:
    "iid" or a profile spec (testing.make_ffn_for)."""
    from twell_compile.testing import make_ffn_for

    p = make_ffn_for(activity, m, k, n, d, t, device=dev, seed=seed, dtype=dt)
    x, wg, wu, wd = (p[a].requires_grad_() for a in ("x", "w_gate", "w_up", "w_down"))
    dy = torch.randn(m, k, device=dev, dtype=torch.float32,
                     generator=torch.Generator(dev).manual_seed(seed + 1)).to(dt)
    return x, wg, wu, wd, dy

def peak_mib(fn, cuda: bool) -> float:
    """MiB ``fn`` allocates above what was allocated before it, at its peak (NaN off CUDA)."""
    if not cuda:
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20
