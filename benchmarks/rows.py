"""The row schema every benchmark results file shares (as Liger-Kernel's BenchmarkDataCSVRow),
and where benchmarks write by default.

Each row (one measured point) starts with where and when it was measured, then the point's
own fields and figures:
    gpu      the CUDA device's name ("NVIDIA H200"), or "cpu: <processor>" on the CPU
    torch    torch.__version__
    triton   Triton's version ("none" where it is not installed)
    commit   ``git rev-parse HEAD`` of the checkout that ran, or "unknown" (no git, no repository);
             $TWELL_COMMIT where set (a copy whose .git is not the checkout's, as on the device)
    time     when the row was stamped, UTC, ISO 8601 ("2026-11-25T17:29:12Z")
A file that is one JSON object (bench_e2e.py, multi_gpu_summary.py) stamps the rows of its
"runs" / "rows" list. Benchmarks write under runs/<tag>/ (gitignored) unless ``--out`` names a
path: a canonical file under benchmarks/results/ is refreshed only by naming it
(benchmarks/results/README.md lists each one's command).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import platform
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

ROOT = Path(__file__).resolve().parent.parent
STAMP = ("gpu", "torch", "triton", "commit", "time")


@functools.lru_cache(maxsize=None)
def processor() -> str:
    """The CPU's model name ("Intel(R) Xeon(R) Processor"), from /proc/cpuinfo where it exists."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def gpu_label(device: Union[torch.device, str, None] = None) -> str:
    """The ``gpu`` field: the CUDA device's name, or "cpu: <processor>"."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu: {processor()}"


@functools.lru_cache(maxsize=None)
def triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "none"


@functools.lru_cache(maxsize=None)
def commit() -> str:
    """$TWELL_COMMIT, else the checkout's HEAD with "+dirty" when tracked files differ from it (the
    device tool's copy of a checkout carries the landed HEAD under the session's code), or
    "unknown" (a copy without .git, no git)."""
    if os.environ.get("TWELL_COMMIT"):
        return os.environ["TWELL_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    head = out.stdout.strip()
    if out.returncode or not head:
        return "unknown"
    return head + ("+dirty" if status.returncode == 0 and status.stdout.strip() else "")


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def stamp(fields: Mapping[str, Any], device: Union[torch.device, str, None] = None, **measured: Any) -> dict[str, Any]:
    """One results row: the schema's five fields, then ``fields`` (which may not carry them).
    ``measured``: stamp fields known from where the point was measured (a run's own JSON read
    by a summary: its gpu, torch) in place of this process's."""
    clash = sorted(set(STAMP) & set(fields))
    unknown = sorted(set(measured) - set(STAMP))
    if clash or unknown:
        raise ValueError(f"row fields {clash} are the stamp's own; {unknown} are not stamp fields {STAMP}")
    here = {"gpu": lambda: gpu_label(device), "torch": lambda: torch.__version__, "triton": triton_version,
            "commit": commit, "time": utc_now}
    return {**{k: measured[k] if measured.get(k) is not None else here[k]() for k in STAMP}, **fields}


def scratch(tag: str, name: str) -> Path:
    """The default output path of a benchmark: runs/<tag>/<name> in the checkout (gitignored)."""
    return ROOT / "runs" / tag / name


def out_path(given: Optional[str], tag: str, name: str) -> Path:
    """--out if given, else ``scratch(tag, name)``; its folder made."""
    path = Path(given) if given else scratch(tag, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Union[Path, str], data: Any) -> None:
    """JSON with one space of indent (the results files' layout), folder made."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
