"""Which CPUs a benchmark's host thread runs on.

On a shared machine the CPUs a process may use need not be equally fast. On the device's H200
VM (16 vCPUs, one NUMA node) a fixed pure-Python loop ran 47-53 ns per iteration on some vCPUs
and 78-92 on others, and a tensor launch 6.3-7.1 us against 9.1-10.2, steady per vCPU (vCPU 2
fast and vCPU 10 slow, pinned, twice each; ``python3 -m benchmarks.host`` prints each CPU's). An unpinned process lands on whichever the scheduler gives it, so a
host-bound comparison moved with it: the 16-layer model at 1 x 2048 tokens in the default mode
read 1.097x and 0.936x of Inductor in two processes of the same command
(results/h200/e2e_prefill_2048_default.json).

``pin`` measures every CPU the process may use and keeps it on the fastest ones (or, to see
what a slow host does, the slowest), before any CUDA work starts; the rows a benchmark writes
carry what it chose (``fields``), so a host-bound reading says which host it had.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

CHOICES = ("fast", "slow", "all")
LOOP = 20000                # iterations per timing (about 1-2 ms)


def _loop_ns(n: int = LOOP) -> float:
    """ns per iteration of a fixed pure-Python loop on the calling thread's CPU."""
    t = time.perf_counter()
    s = 0
    for i in range(n):
        s += i * i
    return (time.perf_counter() - t) / n * 1e9


def allowed() -> list[int]:
    """The CPUs this thread may run on ([] where the platform cannot say or set it)."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))


def speeds(cpus: Optional[list[int]] = None, rounds: int = 3) -> dict[int, float]:
    """Each CPU's best ns per loop iteration over ``rounds`` interleaved passes (the thread
    pinned to each in turn, then given back its affinity). {} where affinity is unavailable."""
    cpus = allowed() if cpus is None else list(cpus)
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return {}
    before = set(allowed())
    best: dict[int, float] = {}
    try:
        for _ in range(max(1, rounds)):
            for c in cpus:
                os.sched_setaffinity(0, {c})
                _loop_ns(LOOP // 10)            # settle on the CPU
                ns = _loop_ns()
                best[c] = min(ns, best.get(c, ns))
    finally:
        os.sched_setaffinity(0, before)
    return best


def choose(measured: dict[int, float], choice: str, tolerance: float = 1.15) -> list[int]:
    """The CPUs of ``measured`` within ``tolerance`` of the fastest ("fast") or of the slowest
    ("slow"), or all of them ("all")."""
    if choice not in CHOICES:
        raise ValueError(f"host CPUs must be one of {CHOICES}, got {choice!r}")
    if tolerance < 1.0:
        raise ValueError(f"tolerance must be >= 1.0, got {tolerance}")
    if not measured or choice == "all":
        return sorted(measured)
    if choice == "fast":
        lo = min(measured.values())
        return sorted(c for c, ns in measured.items() if ns <= lo * tolerance)
    hi = max(measured.values())
    return sorted(c for c, ns in measured.items() if ns * tolerance >= hi)


def pin(choice: str = "fast", tolerance: float = 1.15) -> dict[str, Any]:
    """Measure the allowed CPUs and restrict this thread (and the threads and processes it
    starts later) to ``choose``'s; returns ``fields`` for the rows. Call it before CUDA starts:
    threads already running keep their CPUs."""
    if choice not in CHOICES:
        raise ValueError(f"host CPUs must be one of {CHOICES}, got {choice!r}")
    measured = speeds()
    cpus = choose(measured, choice, tolerance)
    if cpus and choice != "all":
        os.sched_setaffinity(0, set(cpus))
    return fields(choice, measured, cpus)


def fields(choice: str, measured: dict[int, float], cpus: list[int]) -> dict[str, Any]:
    """A row's record of its host: the choice, the CPUs kept and every CPU's loop time (ns)."""
    return dict(host_cpus=choice, host_cpus_kept=cpus,
                host_cpu_loop_ns={str(c): round(ns, 1) for c, ns in sorted(measured.items())})


def add_argument(ap) -> None:
    """The benchmarks' ``--host-cpus`` flag."""
    ap.add_argument("--host-cpus", choices=CHOICES, default="fast",
                    help="run the host thread on the fastest CPUs this process may use (default), the "
                         "slowest (what a slow host does), or wherever the scheduler puts it "
                         "(benchmarks/host.py)")


def main() -> int:
    measured = speeds()
    if not measured:
        print("CPU affinity is not available here")
        return 0
    fast = choose(measured, "fast")
    for c, ns in sorted(measured.items()):
        print(f"cpu {c:3d}: {ns:6.1f} ns per loop iteration{'  (fast)' if c in fast else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
