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
(each a string, or null in a committed row whose run did not record it).
A results file is a JSON list of such rows and nothing else: what a run shares between its
rows (bench_e2e.py's flags, a summary's settings) is a field of each row, and what a point
measured several times (per step, per rank) is a list or object inside its row or one row
each. ``load_rows`` reads a file and refuses any other shape; ``schema_errors`` says what
breaks it (tests/benchmarks/test_results_schema.py holds every committed file to it).
Benchmarks write under runs/<tag>/ (gitignored) unless ``--out`` names a path: a canonical file
under benchmarks/results/ is refreshed only by naming it (benchmarks/results/README.md lists
each one's command).
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


def schema_errors(data: Any) -> list[str]:
    """What keeps ``data`` (a parsed results file) from the schema: not a list, an entry that is
    not an object, a row without one of STAMP's fields, a row not starting with them in their
    order, or one of them neither a string nor null (null: not recorded). Empty when it follows it."""
    if not isinstance(data, list):
        return [f"a JSON {type(data).__name__}, not a list of rows"]
    errors = []
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            errors.append(f"row {i}: a JSON {type(row).__name__}, not an object")
        elif missing := [k for k in STAMP if k not in row]:
            errors.append(f"row {i}: no {missing}")
        elif list(row)[:len(STAMP)] != list(STAMP):
            errors.append(f"row {i}: starts {list(row)[:len(STAMP)]}, not {list(STAMP)}")
        elif typed := [k for k in STAMP if row[k] is not None and not isinstance(row[k], str)]:
            errors.append(f"row {i}: {typed} neither a string nor null")
    return errors


def load_rows(path: Union[Path, str]) -> list[dict[str, Any]]:
    """The rows of a results file; ValueError naming the first few breaks of the schema."""
    data = json.loads(Path(path).read_text())
    errors = schema_errors(data)
    if errors:
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise ValueError(f"{path}: not a results file of rows: {'; '.join(errors[:3])}{more}")
    return data


def write_json(path: Union[Path, str], data: Any) -> None:
    """Rows as JSON with one space of indent (the results files' layout), folder made;
    ValueError, nothing written, where ``data`` breaks the schema."""
    errors = schema_errors(data)
    if errors:
        raise ValueError(f"{path}: not written, not a list of rows: {'; '.join(errors[:3])}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def save_rows(rows: list[dict[str, Any]], given: Optional[str], tag: str, name: str) -> Path:
    """Write a run's rows to ``given`` (default runs/<tag>/<name>, ``out_path``), say where in one
    line, return the path: the end of a tuning script's run."""
    path = out_path(given, tag, name)
    write_json(path, rows)
    print(f"wrote {path} ({len(rows)} rows)")
    return path
