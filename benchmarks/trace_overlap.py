"""Where a multi-GPU training step's time goes, from examples/train_ddp.py --profile traces.

    python3 benchmarks/trace_overlap.py --traces OUT/traces --out OUT/trace_overlap.json

Reads every ``<config>/rank<r>.json.gz`` (Kineto Chrome traces; ``config`` as in
benchmarks/run_multi_gpu.sh) and reports per rank, per profiled step, over the window from the
first GPU activity to the last:
  compute_ms   union of the non-NCCL kernels, copies and sets (what the step computes)
  nccl_ms      union of the NCCL kernels (the wrapper's collectives)
  exposed_ms   NCCL running while nothing else runs: communication the step waits for
  idle_ms      nothing running (host-bound stretches, waits on the host)
  sync_calls   host calls that wait for the GPU (cuda*Synchronize, blocking cudaMemcpy), and
               their total time, the step's closing synchronize included
plus the time of each kernel class (twell's Triton kernels, GEMMs, Inductor's, NCCL, copies)
and the top kernels, so two configurations' compute can be compared kernel by kernel. --out
writes one row per (config, rank) in benchmarks/rows.py's schema (``gpu`` from the trace).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional

if __package__ in (None, ""):                  # run as a file: python3 benchmarks/trace_overlap.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.rows import stamp, write_json  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# Host calls that block until the GPU catches up (cudaStreamWaitEvent only orders streams).
_SYNC = re.compile(r"^cuda(Stream|Device|Event)Synchronize$|^cudaMemcpy$|^cuMemcpyDtoH")
# Kernel classes, first match wins. twell's kernels are Triton kernels named after their role
# (twell_compile/kernels/*.py); Inductor's start with triton_ (or are its fused templates).
CLASSES = (
    ("nccl", re.compile(r"nccl", re.I)),
    ("twell", re.compile(r"^(twell_rows|compact_rows|dx_rows|relu_mul_rows|row_stats|transpose|train_\w+|"
                         r"wgrad|chunk_map|rank|scatter|finish_stats|add_stats|decode_\w+)_kernel")),
    ("inductor", re.compile(r"^triton_", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|sm90_|sm80_|cublas", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
)


def kernel_class(name: str, cat: str) -> str:
    if cat != "kernel":
        return "copy/set"
    for label, pat in CLASSES:
        if pat.search(name):
            return label
    return "other"


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of union ``a`` not covered by union ``b`` (both sorted and disjoint)."""
    total, j = 0.0, 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            total += e - cur
    return total


def load(path: Path) -> tuple[list[dict[str, Any]], Optional[str]]:
    """A trace's events and the name of its first GPU (Kineto's deviceProperties), if any."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        return data, None
    props = data.get("deviceProperties") or [{}]
    return data["traceEvents"], props[0].get("name")


def analyze(events: list[dict[str, Any]], steps: int, top: int = 20) -> dict[str, Any]:
    """The per-step breakdown of one rank's trace (``steps`` profiled steps)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "dur" in e]
    if not gpu:
        raise ValueError("the trace has no GPU activity (profiled with CUDA activity?)")
    steps = max(steps, 1)
    classes = [kernel_class(e["name"], e["cat"]) for e in gpu]
    nccl = _union((e["ts"], e["ts"] + e["dur"]) for e, c in zip(gpu, classes) if c == "nccl")
    compute = _union((e["ts"], e["ts"] + e["dur"]) for e, c in zip(gpu, classes) if c != "nccl")
    start = min(e["ts"] for e in gpu)
    end = max(e["ts"] + e["dur"] for e in gpu)
    busy = _union(nccl + compute)
    by_class: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e, c in zip(gpu, classes):
        by_class[c] += e["dur"]
        k = by_kernel[e["name"][:120]]
        k[0] += e["dur"]
        k[1] += 1
    syncs = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
             and _SYNC.search(e.get("name", ""))]
    ms = 1e-3 / steps   # us over the window -> ms per step
    return {
        "steps": steps,
        "window_ms": round((end - start) * ms, 3),
        "compute_ms": round(_length(compute) * ms, 3),
        "nccl_ms": round(_length(nccl) * ms, 3),
        "exposed_ms": round(minus(nccl, compute) * ms, 3),
        "idle_ms": round(((end - start) - _length(busy)) * ms, 3),
        "sync_calls": round(len(syncs) / steps, 2),
        "sync_ms": round(sum(e["dur"] for e in syncs) * ms, 3),
        "class_ms": {k: round(v * ms, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n, "ms": round(v[0] * ms, 3), "calls": round(v[1] / steps, 2)}
                        for n, v in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def summarize(traces: Path, steps: int) -> list[dict[str, Any]]:
    """One stamped row per trace, ``config`` and ``rank`` (its folder and file) then ``analyze``'s
    fields; ``gpu`` the trace's own device (else the first trace's that names one)."""
    found = [(path, *load(path)) for path in sorted(traces.glob("*/rank*.json*"))]
    if not found:
        raise ValueError(f"no <config>/rank<r>.json[.gz] traces under {traces}")
    first = next((name for _, _, name in found if name), None)
    return [stamp({"config": path.parent.name, "rank": path.name.split(".")[0], **analyze(events, steps)},
                  gpu=name or first) for path, events, name in found]


def report(rows: list[dict[str, Any]]) -> str:
    lines = ["| config | rank | window | compute | NCCL | exposed NCCL | idle | syncs | twell | GEMM | Inductor |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["class_ms"]
        lines.append(f"| {r['config']} | {r['rank']} | {r['window_ms']:.2f} | {r['compute_ms']:.2f} | {r['nccl_ms']:.2f} "
                     f"| {r['exposed_ms']:.2f} | {r['idle_ms']:.2f} | {r['sync_calls']:g} ({r['sync_ms']:.2f}) "
                     f"| {c.get('twell', 0):.2f} | {c.get('gemm', 0):.2f} | {c.get('inductor', 0):.2f} |")
    return f"ms per step, {rows[0]['gpu']}\n" + "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", required=True, type=Path, help="folder of <config>/rank<r>.json.gz")
    ap.add_argument("--steps", type=int, default=2, help="profiled steps per trace (train_ddp --profile)")
    ap.add_argument("--out", type=Path, default=None, help="write the breakdown JSON here")
    a = ap.parse_args(argv)
    rows = summarize(a.traces, a.steps)
    print(report(rows))
    if a.out:
        write_json(a.out, rows)
    return rows


if __name__ == "__main__":
    main()
