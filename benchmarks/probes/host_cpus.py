"""How fast each CPU this process may use runs Python, pass after pass: whether a benchmark's
host time depends on where the scheduler puts it.

    python3 benchmarks/probes/host_cpus.py --passes 6 --every 10

Per pass and CPU: ns per iteration of a fixed pure-Python loop, the thread pinned to that CPU
(best of ``--rounds``), then its affinity given back. A host-bound comparison (a compiled
module whose host time per call is near its GPU time) reads whatever its CPU's column says at
the time; a CPU that is fast in every pass would be worth pinning to, one that is not, not.
On the H200 VM (16 vCPUs, one NUMA node) one pass read 55-59 ns on 9 vCPUs and 65-93 on 7;
a minute later the fast set was another, so a process pinned at start to the fastest did not
keep a fast host (results/h200/e2e_prefill_2048_default.json: rows with env.host_cpus).
"""

from __future__ import annotations

import argparse
import os
import time

LOOP = 20000                # iterations per timing (about 1-2 ms)


def loop_ns(n: int = LOOP) -> float:
    """ns per iteration of a fixed pure-Python loop on the calling thread's CPU."""
    t = time.perf_counter()
    s = 0
    for i in range(n):
        s += i * i
    return (time.perf_counter() - t) / n * 1e9


def speeds(cpus: list[int], rounds: int = 3) -> dict[int, float]:
    """Each CPU's best ns per loop iteration over ``rounds`` interleaved passes, the thread
    pinned to each in turn; the affinity it had is given back."""
    before = os.sched_getaffinity(0)
    best: dict[int, float] = {}
    try:
        for _ in range(max(1, rounds)):
            for c in cpus:
                os.sched_setaffinity(0, {c})
                loop_ns(LOOP // 10)            # settle on the CPU
                ns = loop_ns()
                best[c] = min(ns, best.get(c, ns))
    finally:
        os.sched_setaffinity(0, before)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=3, help="passes over the CPUs")
    ap.add_argument("--every", type=float, default=5.0, help="seconds from one pass's start to the next's")
    ap.add_argument("--rounds", type=int, default=3, help="timings per CPU and pass (the best is kept)")
    a = ap.parse_args(argv)
    if a.passes < 1 or a.rounds < 1 or a.every < 0:
        ap.error("--passes and --rounds must be >= 1, --every >= 0")
    if not hasattr(os, "sched_setaffinity"):
        print("CPU affinity is not available on this platform")
        return 0
    cpus = sorted(os.sched_getaffinity(0))
    print("pass " + " ".join(f"{'cpu' + str(c):>7}" for c in cpus), flush=True)
    for p in range(a.passes):
        start = time.perf_counter()
        got = speeds(cpus, a.rounds)
        print(f"{p:4d} " + " ".join(f"{got[c]:7.1f}" for c in cpus), flush=True)
        if p + 1 < a.passes:
            time.sleep(max(0.0, a.every - (time.perf_counter() - start)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
