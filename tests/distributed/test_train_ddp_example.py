"""examples/train_ddp.py under torchrun on 2 CPU processes (gloo): it trains, and with 1 MB DDP
buckets (0.5 MB weights: splits inside FFNs) the prepared model keeps every FFN on every rank."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.rows import schema_errors

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


def one_row(path: Path) -> dict:
    """The summary: the one row of the results file --out wrote (benchmarks/rows.py's schema)."""
    rows = json.loads(path.read_text())
    assert not schema_errors(rows) and len(rows) == 1, rows
    return rows[0]


def _run(cmd: list[str], out: Path, **kw) -> dict:
    """Runs ``cmd``, failing with the tail of its output (CI shows only part of a log), and
    returns the summary it wrote. One exception: a run that wrote a complete summary and then
    failed (a crash at exit, most likely gloo's teardown: seen once, in stop 20's CI; not
    reproduced in 15 local runs) runs once more, and that second run must exit cleanly."""
    for attempt in (0, 1):
        out.unlink(missing_ok=True)
        proc = subprocess.run(cmd, cwd=ROOT, timeout=600, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, **kw)
        summary = one_row(out) if out.exists() else None
        if proc.returncode == 0:
            return summary
        if attempt or summary is None or not summary.get("complete"):
            break
        print(f"run exited {proc.returncode} after a complete summary; once more. Its output's tail:\n"
              f"{proc.stdout[-3000:]}")
    pytest.fail(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-6000:]}")


@pytest.mark.slow
def test_train_ddp_example_on_two_cpu_processes(tmp_path, wrap="ddp"):
    # ~45 s on 2 cores (compiles dominate); --wrap fsdp2 passes the same checks (run by hand:
    # FSDP2 itself is covered in test_ddp_fsdp.py).
    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train_ddp.py"), "--device", "cpu", "--tiny", "--wrap", wrap, "--steps", "3",
           "--warmup", "1", "--hidden", "128", "--ffn", "1024", "--bucket-cap-mb", "1", "--out", str(out)]
    summary = _run(cmd, out)
    assert len(summary["losses"]) == 3 and all(4.0 < v < 7.0 for v in summary["losses"]), summary["losses"]
    for rank in summary["ranks"]:
        assert rank["prepared"] == ["model.layers.0.mlp", "model.layers.1.mlp"], rank
        assert sorted(rank["rewritten"]) == [f"model.layers.{i}.mlp -> twell::ffn_train (prepared)" for i in (0, 1)], rank
        assert not rank["left_to_inductor"] and rank["peak_memory_mb"] > 0, rank


def _train(tmp_path, name, *argv, nproc=None):
    out = tmp_path / f"{name}.json"
    launch = [sys.executable] if nproc is None else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     "--nproc-per-node", str(nproc)]
    cmd = [*launch, str(ROOT / "examples" / "train_ddp.py"), "--device", "cpu", "--tiny", "--backend", "eager",
           "--density", "0.1", "--global-batch", "4", "--steps", "3", "--warmup", "1", "--fixed-batch",
           "--calib-cache", str(tmp_path / "gate_bias.pt"), "--out", str(out), *argv]
    return _run(cmd, out, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_one_process_with_accumulation_matches_two_ranks(tmp_path):
    """The reference run of benchmarks/run_multi_gpu.sh: 1 process (no torchrun, no wrapper), 2
    micro-batches, sees the tokens of 2 DDP / FSDP2 ranks and averages the same gradients. The
    model is bench_e2e's with gate biases calibrated to 0.1, computed once and then read from
    the cache (~45 s on 2 cores: eager, no compiles)."""
    one = _train(tmp_path, "one", "--wrap", "none", "--accum", "2")
    assert one["world"] == 1 and one["accum"] == 2 and one["size"]["batch"] == 2 and one["complete"]
    assert one["calibration_source"] == "calibrated" and abs(one["density_calibration_mean"] - 0.1) < 1e-3
    assert all(0.05 < d < 0.2 for d in one["density_first_batch"]), one["density_first_batch"]
    assert one["losses"][-1] < one["losses"][0] - 0.05, one["losses"]   # one fixed batch: the loss falls
    for wrap in ("ddp", "fsdp2"):
        two = _train(tmp_path, wrap, "--wrap", wrap, nproc=2)
        assert two["world"] == 2 and two["size"]["batch"] == 2 and two["calibration_source"] == "cache"
        assert two["density_first_batch"] == one["density_first_batch"]
        assert two["losses"] == pytest.approx(one["losses"], abs=1e-4), (wrap, two["losses"], one["losses"])
        assert all(r["peak_memory_mb"] > 0 for r in two["ranks"])
