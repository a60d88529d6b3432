"""benchmarks/trace_overlap.py on a synthetic Chrome trace: the unions, exposed communication,
idle time, host syncs and kernel classes, per step."""

import gzip
import json

import pytest

from benchmarks import trace_overlap as TO
from benchmarks.rows import STAMP, load_rows


def _k(name, ts, dur, cat="kernel", stream=7):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": stream}


EVENTS = [
    _k("twell_rows_kernel", 0, 10),
    _k("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 5, 15, stream=20),     # 10..20 runs alone
    _k("sm90_xmma_gemm_bf16bf16_bf16f32", 25, 5),
    _k("Memcpy DtoD (Device -> Device)", 30, 2, cat="gpu_memcpy"),
    _k("triton_poi_fused_add_0", 8, 1),                                    # inside twell's span
    _k("cudaStreamSynchronize", 40, 3, cat="cuda_runtime"),
    _k("cudaLaunchKernel", 1, 1, cat="cuda_runtime"),                      # not a sync
    {"ph": "i", "cat": "kernel", "name": "marker", "ts": 100},            # not a span
]


def test_breakdown_of_one_step():
    r = TO.analyze(EVENTS, steps=1)
    # window 0..32 us; compute [0,10] + [25,32]; NCCL [5,20]; nothing in [20,25]
    assert r["window_ms"] == pytest.approx(0.032)
    assert r["compute_ms"] == pytest.approx(0.017)
    assert r["nccl_ms"] == pytest.approx(0.015)
    assert r["exposed_ms"] == pytest.approx(0.010)
    assert r["idle_ms"] == pytest.approx(0.005)
    assert r["sync_calls"] == 1 and r["sync_ms"] == pytest.approx(0.003)
    assert r["class_ms"] == {"twell": 0.01, "nccl": 0.015, "gemm": 0.005, "copy/set": 0.002, "inductor": 0.001}
    assert r["top_kernels"][0] == {"name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ms": 0.015, "calls": 1}


def test_per_step_values_divide_by_steps():
    slow = [{**e, "ts": e["ts"] * 1000, **({"dur": e["dur"] * 1000} if "dur" in e else {})} for e in EVENTS]
    two = TO.analyze(slow, steps=2)
    assert two["compute_ms"] == pytest.approx(8.5) and two["exposed_ms"] == pytest.approx(5.0)
    assert two["sync_calls"] == 0.5


def test_minus_counts_only_uncovered_parts():
    a = [(0.0, 10.0), (20.0, 30.0)]
    b = [(2.0, 4.0), (5.0, 25.0)]
    assert TO.minus(a, b) == pytest.approx(2 + 1 + 5)
    assert TO.minus(a, []) == 20 and TO.minus([], b) == 0


def test_summary_reads_gzipped_traces_per_config(tmp_path):
    for config in ("ddp_twell", "ddp_inductor"):
        (tmp_path / config).mkdir()
        for rank in (0, 1):
            with gzip.open(tmp_path / config / f"rank{rank}.json.gz", "wt") as f:
                json.dump({"traceEvents": EVENTS, "deviceProperties": [{"name": "NVIDIA H200"}]}, f)
    rows = TO.main(["--traces", str(tmp_path), "--steps", "1", "--out", str(tmp_path / "overlap.json")])
    assert load_rows(tmp_path / "overlap.json") == rows
    assert [(r["config"], r["rank"]) for r in rows] == [("ddp_inductor", "rank0"), ("ddp_inductor", "rank1"),
                                                        ("ddp_twell", "rank0"), ("ddp_twell", "rank1")]
    assert all(list(r)[:5] == list(STAMP) and r["gpu"] == "NVIDIA H200" and r["steps"] == 1 for r in rows)
    text = TO.report(rows)
    assert text.startswith("ms per step, NVIDIA H200") and "| ddp_twell | rank1 | 0.03 |" in text


def test_trace_without_gpu_activity_is_refused():
    with pytest.raises(ValueError, match="no GPU activity"):
        TO.analyze([_k("cudaLaunchKernel", 0, 1, cat="cuda_runtime")], steps=1)
