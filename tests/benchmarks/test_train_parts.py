"""benchmarks/train_parts.py without a GPU: the launch labelling of both sides on recorded
kernel-name sequences, the row building and table on fake timings, the timing helpers it adds
(timers in interleaved rounds, after_ms, kernel_parts), and the whole harness in its --smoke
mode (our parts through the Triton interpreter, one row per part, positive times; what needs
CUDA skipped with its reason)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks import reference, timing, train_parts
from benchmarks.rows import ROOT, STAMP

POINT = dict(M=16, K=64, N=160, density=0.005, tail=0.0, activity="iid", dtype="float16")

# our op's step as the profiler lists it (names shortened as the profiler gives them)
OURS_FWD = ["nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "void at::native::vectorized_elementwise_kernel<4, "
            "at::native::FillFunctor<int>>", "Memset (Device)", "compact_rows_kernel", "transpose_kernel",
            "train_fwd_kernel", "void at::native::clamp_min_kernel"]
OURS_BWD = ["Memset (Device)", "rank_kernel", "train_bwd_kernel", "void at::native::cumsum_kernel", "scatter_kernel",
            "nvjet_tst_small", "chunk_map_kernel", "wgrad_kernel", "wgrad_kernel", "dx_rows_kernel",
            "void at::native::copy_kernel", "transpose_kernel"]
# ff_forward_cuda_gated / ff_backward_cuda_gated's launches in their order
PAPER_FWD = ["Memset (Device)", "mm_wgmma_nt_kernel", "blocked_ell_to_ell_packed_kernel",
             "overflow_tail_from_packed_kernel", "Memcpy DtoH (Device -> Pinned)",
             "FillFunctor<c10::BFloat16>", "dense_ab_as_sparse_hybrid_unified_optimized",
             "sparse_elementwise_product", "ell_spmm_rowmajor_b_rowwise_optimized", "nvjet_tst",
             "scatter_tail_dense_rows_into_full"]
PAPER_BWD = ["FillFunctor<c10::BFloat16>", "transpose_hybrid_ell_dense", "promote_overflow_rows_ell_into_tail_dense",
             "dense_ab_as_sparse_hybrid_unified_optimized", "shift_dT_for_l1_ell_kernel",
             "sparse_elementwise_product", "fused_dU_ell_kernel", "Memcpy DtoD (Device -> Device)",
             "transpose_hybrid_ell_dense", "transpose_hybrid_ell_dense",
             "ell_spmm_rowmajor_b_rowwise_optimized", "ell_spmm_rowmajor_b_rowwise_optimized", "nvjet_tst",
             "scatter_tail_dense_rows_into_full", "CUDAFunctor_add<c10::BFloat16>",
             "ell_spmm_rowmajor_b_rowwise_optimized", "ell_spmm_rowmajor_b_rowwise_optimized",
             "ell_spmm_rowmajor_b_rowwise_optimized", "scatter_tail_dense_rows_into_full"]


def test_our_launches_are_labelled_by_name_and_position():
    assert train_parts.classify_ours(0, OURS_FWD) == [
        "fwd.gate_gemm", "fwd.fill_copy", "fwd.fill_copy", "fwd.pack", "fwd.up_down", "fwd.up_down", "fwd.other"]
    assert train_parts.classify_ours(1, OURS_BWD) == [
        "bwd.fill_copy", "bwd.setup", "bwd.setup", "bwd.setup", "bwd.setup", "bwd.setup", "bwd.setup",
        "bwd.wgrad_dy", "bwd.wgrad_x", "bwd.dx", "bwd.outputs", "bwd.outputs"]
    labels = {p for p, _ in train_parts.OURS_KERNEL_PARTS}
    assert set(train_parts.classify_ours(0, OURS_FWD) + train_parts.classify_ours(1, OURS_BWD)) <= labels


def test_the_papers_launches_are_labelled_by_their_order():
    assert reference.classify_paper(0, PAPER_FWD) == [
        "fwd.fill_copy", "fwd.gate_pack", "fwd.gate_pack", "fwd.gate_pack", "fwd.fill_copy", "fwd.fill_copy",
        "fwd.up_down", "fwd.up_down", "fwd.up_down", "fwd.up_down", "fwd.up_down"]
    got = reference.classify_paper(1, PAPER_BWD)
    assert got[:10] == ["bwd.fill_copy", "bwd.transpose", "bwd.transpose", "bwd.dh", "bwd.dh", "bwd.dh", "bwd.dh",
                        "bwd.fill_copy", "bwd.transpose", "bwd.transpose"]
    assert got[10:15] == ["bwd.dx"] * 5                       # both spmm, the tail GEMM, its scatter, the sum
    assert got[15:] == ["bwd.wgrad_up", "bwd.wgrad_gate", "bwd.wgrad_down", "bwd.wgrad_down"]
    assert reference.classify_paper(1, ["ell_spmm_x"] * 6)[-1] == "bwd.unattributed"
    assert set(got) <= {p for p, _ in reference.PAPER_KERNEL_PARTS}


def test_kernel_parts_sums_per_label_and_step():
    phases = [[("a", 10.0), ("b", 30.0)], [("c", 5.0)], [("a", 20.0), ("b", 10.0)], [("c", 15.0)], [("a", 1e9)]]
    classify = lambda phase, names: [f"{phase}{n}" for n in names]   # noqa: E731
    got = timing.kernel_parts(phases, 2, classify)                   # the fifth phase: no whole step, dropped
    assert got == pytest.approx({"0a": 0.015, "0b": 0.02, "1c": 0.01})
    with pytest.raises(ValueError, match="fewer than one step"):
        timing.kernel_parts(phases[:1], 2, classify)


def test_interleaved_rounds_take_timers_beside_do_bench(monkeypatch):
    calls = []
    monkeypatch.setattr(timing, "median_ms", lambda fn, rep: (calls.append(("bench", rep)), fn())[1])
    got = timing.interleaved_ms({"a": lambda: 2.0}, reps=40, rounds=2,
                                timers={"b": lambda rep: (calls.append(("timer", rep)), 3.0)[1]})
    assert got == {"a": 2.0, "b": 3.0}
    assert calls == [("bench", 20), ("timer", 20), ("timer", 20), ("bench", 20)]
    with pytest.raises(ValueError, match="both"):
        timing.interleaved_ms({"a": lambda: 0}, 10, 1, timers={"a": lambda rep: 0.0})


def test_after_ms_times_the_call_after_its_setup_only():
    import time

    seen = []
    ms = timing.after_ms(lambda: time.sleep(0.02) or len(seen), lambda s: (seen.append(s), time.sleep(0.002)),
                         reps=10, cuda=False)
    assert 1.5 < ms < 15                                    # the 20 ms setup not counted
    assert seen == list(range(len(seen))) and len(seen) >= 2 + 5


def test_part_rows_one_per_part_with_status_and_table():
    rows = train_parts.part_rows(POINT, "ours", train_parts.OURS_PARTS, {"fwd": 1.5, "bwd": 2.5}, dev="cpu")
    assert [r["part"] for r in rows] == [p for p, _, _ in train_parts.OURS_PARTS]
    assert all(tuple(r)[:len(STAMP)] == STAMP for r in rows)
    by = {r["part"]: r for r in rows}
    assert by["fwd"]["ms"] == 1.5 and by["fwd"]["status"] == "ok" and by["fwd"]["method"] == "do_bench"
    assert math.isnan(by["bwd.dx"]["ms"]) and by["bwd.dx"]["status"].startswith("missing")
    skipped = train_parts.part_rows(POINT, "paper", reference.PAPER_KERNEL_PARTS, {"kernels": 1.0},
                                    "no --reference DIR", dev="cpu")
    assert all(r["method"] == "kernels" and math.isnan(r["ms"]) and r["status"] == "skipped: no --reference DIR"
               for r in skipped)
    crashed = train_parts.part_rows(POINT, "paper", reference.PAPER_PARTS, {}, status="crashed rc=-11 (SIGSEGV): ",
                                    dev="cpu")
    assert all(r["status"].startswith("crashed") and math.isnan(r["ms"]) for r in crashed)
    text = train_parts.table(rows + [dict(r, M=64) for r in rows])
    assert "M=16" in text and "M=64" in text
    assert any(line.split()[2] == "fwd" and line.split()[3] == "1.500" for line in text.splitlines()[1:])


def test_smoke_refuses_the_reference_and_a_run_without_cuda_asks_for_smoke(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        train_parts.main(["--smoke", "--reference", "x"])
    assert "not with --smoke" in capsys.readouterr().err
    monkeypatch.setattr(train_parts.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        train_parts.main([])
    assert "--smoke" in capsys.readouterr().err


def test_smoke_mode_gives_one_row_per_part(tmp_path):
    """The harness end to end on the CPU (a subprocess: the interpreter is chosen when the
    kernels are defined): our parts measured, positive; the rest skipped with a reason."""
    triton = pytest.importorskip("triton")
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run the training kernels")
    out = tmp_path / "parts.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_parts.py"), "--smoke", "--M", "16",
                        "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())
    want = ([("ours", p) for p, _, _ in train_parts.OURS_PARTS] + [("eager", "step"), ("inductor", "step")]
            + [("ours", p) for p, _ in train_parts.OURS_KERNEL_PARTS]
            + [("paper", p) for p, _, _ in reference.PAPER_PARTS] + [("paper", p) for p, _ in reference.PAPER_KERNEL_PARTS])
    assert [(row["impl"], row["part"]) for row in rows] == want
    measured = {(row["impl"], row["method"], row["part"]) for row in rows if row["status"] == "ok"}
    assert measured == ({("ours", "host_clock", p) for p, _, _ in train_parts.OURS_PARTS[:12]}
                        | {("eager", "host_clock", "step")})
    for row in rows:
        assert row["gpu"].startswith("cpu: ") and row["M"] == 16 and row["dtype"] == "float16"
        if (row["impl"], row["method"], row["part"]) in measured:
            assert row["ms"] > 0 and row["method"] == "host_clock", row
        else:
            assert row["status"].startswith("skipped: ") and math.isnan(row["ms"]), row
    assert "fwd.up_down" in r.stdout and "wrote" in r.stdout


def test_the_papers_child_prints_its_parts_on_a_stand_in(tmp_path):
    """reference.py --train-parts through a plain-torch stand-in of their op (test_reference.py's)
    on the CPU: the four PAPER_PARTS, positive, bwd_derived = step - fwd; no profiler parts off CUDA."""
    from tests.benchmarks.test_reference import FAKE_LOADER

    (tmp_path / "custom_models" / "hybrid_modules").mkdir(parents=True)
    (tmp_path / "custom_models" / "hybrid_modules" / "sparse_ops_loader.py").write_text(FAKE_LOADER)
    ref = str(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "benchmarks.reference", "--train-parts", ref, "16", "64", "128", "0.05",
                        "0.0", "1", "--reps", "10", "--device", "cpu"], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    parts = {p["part"]: p for p in reference.parse_line(r.stdout)["parts"]}
    assert list(parts) == [p for p, _, _ in reference.PAPER_PARTS]
    assert all(parts[p]["ms"] > 0 for p in ("fwd", "bwd", "step"))
    assert parts["bwd_derived"]["ms"] == pytest.approx(parts["step"]["ms"] - parts["fwd"]["ms"])
