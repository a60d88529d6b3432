"""benchmarks/run_multi_gpu.sh on the CPU (DEVICE=cpu TINY=1, gloo), two of its six runs: the
layout under $OUT (profiler traces included), the rc lines, and a summary whose 2-process losses
equal the 1-process ones with a penalty that moves them.
About 65 s on 2 cores (two twell compiles of the tiny model)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.rows import load_rows

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="bash, torchrun with gloo")
def test_script_on_cpu_tiny(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "WORK": str(tmp_path / "work"), "DEVICE": "cpu", "TINY": "1",
           "SKIP_INSTALL": "1", "CONFIGS": "single_twell ddp_twell", "STEPS": "3",
           # a penalty strong enough to move the loss: the 1-process run's 2 accumulated calls
           # must each get l1 / 2 for its losses to equal DDP's (3.5e-3 apart when each got l1)
           "L1": "20", "PROFILE": "1"}
    res = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_multi_gpu.sh")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["multi_gpu_summary.json", "run.log", "runs/ddp_twell.json", "runs/single_twell.json",
                     "traces/ddp_twell/rank0.json.gz", "traces/ddp_twell/rank1.json.gz",
                     "traces/single_twell/rank0.json.gz"], files   # trace_overlap.py: CUDA runs only
    log = (out / "run.log").read_text()
    assert "### end single_twell rc=0" in log and "### end ddp_twell rc=0" in log
    assert "NCCL_NVLS_ENABLE=0" in log
    s = load_rows(out / "multi_gpu_summary.json")
    rows = {r["config"]: r for r in s}
    assert rows["single_twell"]["complete"] and rows["ddp_twell"]["complete"]
    assert rows["ddp_twell"]["ffns_rewritten_per_rank"] == [2, 2]
    assert rows["single_twell"]["ffns_rewritten_per_rank"] == [2]
    agree = rows["ddp_twell"]["loss_vs_1gpu"]
    assert agree["steps_compared"] == 3 and agree["max_abs"] < 1e-4, agree
    (single,) = load_rows(out / "runs" / "single_twell.json")
    assert single["accum"] == 2 and single["l1"] == 20 and single["l1_per_call"] == 10 and single["profiled_steps"] == 1
    assert s[0]["settings"]["fixed_batch"] and s[0]["settings"]["density_target"] == 0.1
    assert "| 2x cpu | DDP | twell (prepared) |" in res.stdout
