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


def interleaved_ms(fns: Mapping[str, Callable[[], object]], reps: int, rounds: int = 5,
                   timers: Optional[Mapping[str, Callable[[int], float]]] = None) -> dict[str, float]:
    """Median ms per variant over ``rounds`` rounds; each round times every variant once
    (do_bench, rep ``reps // rounds`` ms), starting one variant later each round. Timed one
    after the other instead, the same dense call read 5-24% apart at K=4096 (H200, 2026-11-23:
    the op's dense path 6.53 vs eager 6.47 ms interleaved, 0.86-0.95x in the grid's order).
    ``timers``: variants timed by their own function of the rep budget (``after_ms``, or the
    CPU's wall clock) in place of do_bench, in the same rotation after ``fns``' variants."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    timers = dict(timers or {})
    clash = sorted(set(fns) & set(timers))
    if clash:
        raise ValueError(f"variants {clash} given both a callable and a timer")
    run = {**{name: (lambda rep, fn=fn: median_ms(fn, rep)) for name, fn in fns.items()}, **timers}
    names = list(run)
    got: dict[str, list[float]] = {name: [] for name in names}
    rep = max(10, reps // rounds)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            got[name].append(run[name](rep))
    return {name: sorted(v)[len(v) // 2] for name, v in got.items()}


def after_ms(setup: Callable[[], object], fn: Callable[[object], object], reps: int, cuda: bool = True) -> float:
    """Median ms of ``fn(setup())`` counting ``fn`` only: for a call that cannot run twice on one
    input (the paper's backward consumes its forward's saved state). Each sample runs ``setup``
    untimed on the same stream, then ``fn`` between two CUDA events (host wall clock off CUDA);
    the L2 is not flushed between them, as in a training step where the backward follows its
    forward. Samples: about ``reps`` ms of ``fn`` (at least 5), after 2 warm-up calls."""
    def once() -> float:
        state = setup()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(state)
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn(state)
        return (time.perf_counter() - t0) * 1e3

    for _ in range(2):
        once()
    first = once()
    n = max(5, min(1000, int(reps / max(first, 1e-3))))
    samples = sorted([first] + [once() for _ in range(n - 1)])
    return samples[len(samples) // 2]


MARK = "spin_kernel"       # the kernel of torch.cuda._sleep: kernel_phases' phase marker


def mark_phase() -> None:
    """Launch the phase marker ``kernel_phases`` splits a profiled stream at (torch.cuda._sleep of
    one cycle: a few microseconds, in profiled calls only)."""
    torch.cuda._sleep(1)


def kernel_phases(fn: Callable[[], object], steps: int) -> list[list[tuple[str, float]]]:
    """The device activity (kernels, memcpys, memsets) of ``steps`` calls of ``fn`` under
    torch.profiler, in the order it ran on the device, cut into phases at each ``mark_phase``
    kernel (``fn`` launches one before each of its phases; what runs before the first mark is
    dropped, the marks themselves too): a list of phases, each [(name, us), ...]."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    phases: list[list[tuple[str, float]]] = []
    for e in events:
        if MARK in e.name:
            phases.append([])
        elif phases:
            phases[-1].append((e.name, float(e.time_range.end - e.time_range.start)))
    return phases


def kernel_parts(phases: list[list[tuple[str, float]]], per_step: int,
                 classify: Callable[[int, list[str]], list[str]]) -> dict[str, float]:
    """ms per step of each part: ``phases`` (kernel_phases, ``per_step`` phases a step) with each
    phase's kernels labelled by ``classify(phase index within the step, names) -> labels``, the
    durations summed per label and divided by the number of whole steps."""
    steps = len(phases) // per_step
    if steps == 0:
        raise ValueError(f"{len(phases)} phases: fewer than one step of {per_step}")
    out: dict[str, float] = {}
    for i, phase in enumerate(phases[:steps * per_step]):
        labels = classify(i % per_step, [name for name, _ in phase])
        for label, (_, us) in zip(labels, phase):
            out[label] = out.get(label, 0.0) + us / 1e3 / steps
    return out


def policy_changes(pairs) -> dict:
    """--policy FIELD=VALUE pairs as arch.patched's keyword arguments, each value in the type
    of the record's field ("wg_chunk=256" -> {"wg_chunk": 256})."""
    from twell_compile.runtime import arch
    out = {}
    for kv in pairs:
        field, sep, value = kv.partition("=")
        if not sep or not hasattr(arch.H200, field):
            raise ValueError(f"--policy {kv!r}: expected FIELD=VALUE with FIELD a GpuPolicy field")
        kind = type(getattr(arch.H200, field))
        if kind is bool:      # bool("0") is True
            if value.lower() not in ("0", "1", "false", "true"):
                raise ValueError(f"--policy {kv!r}: {field} takes 0/1 or false/true")
            out[field] = value.lower() in ("1", "true")
        else:
            out[field] = kind(value)
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
