"""benchmarks/reference.py without a GPU: a folder that is not the reference is refused with the
fix named, and a reference that crashes its process leaves a row marked crashed, not a dead
benchmark. The training mode (bench_ffn_train.py --reference): the child's line parsed, its
crashes and timeouts recorded (subprocess.run faked, or a stand-in reference in plain torch on
the CPU), and the benchmark's rows and table carrying its columns."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import pytest

from benchmarks import bench_ffn_train, reference


def test_a_folder_without_the_reference_is_refused(tmp_path):
    with pytest.raises(ValueError, match="sparser-faster-llms"):
        reference.run_point(str(tmp_path), 16, 64, 128, 0.01, 0.0, 1)


def test_a_crashing_reference_gives_a_crashed_row(tmp_path):
    mod = tmp_path / "custom_models" / "twell_modules"
    mod.mkdir(parents=True)
    (mod / "twell.py").write_text("import os\nos.abort()\n")      # dies as a segfault would
    row = reference.run_point(str(tmp_path), 16, 64, 128, 0.01, 0.0, 1, reps=10, rounds=1, timeout=120)
    assert row["ref_status"].startswith("crashed rc="), row
    assert math.isnan(row["ref_ms"]) and math.isnan(row["ref_rel_err"])


# A stand-in for the paper's training op, in plain torch and their layout (x [B, S, K], w_down
# [N, K]): enough for the child's plumbing on the CPU.
FAKE_LOADER = '''
import torch

def load_sparse_ops():
    lib = torch.library.Library("sparse_ops", "DEF")
    lib.define("ff_forward_gated(Tensor X, Tensor G, Tensor K, Tensor V) -> (Tensor, Tensor, Tensor)")

    def ff(x, g, k, v):
        h = torch.relu(x @ g.t()) * (x @ k.t())
        return h @ v, h.new_zeros(()), h.new_zeros(())

    lib.impl("ff_forward_gated", ff, "CompositeImplicitAutograd")
    globals()["_lib"] = lib
'''


def _fake_reference(tmp_path, loader: str):
    mod = tmp_path / "custom_models" / "hybrid_modules"
    mod.mkdir(parents=True)
    (mod / "sparse_ops_loader.py").write_text(loader)
    return str(tmp_path)


def test_a_folder_without_the_training_reference_is_refused(tmp_path):
    (tmp_path / "custom_models" / "twell_modules").mkdir(parents=True)      # inference only
    (tmp_path / "custom_models" / "twell_modules" / "twell.py").write_text("")
    for call in (lambda: reference.run_train_point(str(tmp_path), 16, 64, 128, 0.01, 0.0, 1),
                 lambda: reference.build_train(str(tmp_path)),
                 lambda: bench_ffn_train.main(["--reference", str(tmp_path)])):
        with pytest.raises(ValueError, match=r"--reference .*hybrid_modules/sparse_ops_loader\.py.*"
                                             r"sparser-faster-llms folder"):
            call()


def test_bench_ffn_train_refuses_the_reference_off_the_grid(tmp_path, capsys):
    ref = _fake_reference(tmp_path, FAKE_LOADER)
    for flag in ("--quick", "--parts"):
        with pytest.raises(SystemExit):
            bench_ffn_train.main(["--reference", ref, flag])
        assert "--reference runs on CUDA" in capsys.readouterr().err


def test_the_childs_line_is_parsed():
    out = ("loading...\nREF {\"ref_ms\": 1.0}\nwarning: REF not at the start\n"
           "REF {\"ref_ms\": 2.5, \"ref_grad_rel_err\": NaN, \"ref_grad_rel_errs\": {\"x\": 0.004}}\n")
    row = reference.parse_line(out)
    assert row["ref_ms"] == 2.5 and math.isnan(row["ref_grad_rel_err"])
    assert row["ref_grad_rel_errs"] == {"x": 0.004}
    assert reference.parse_line("Segmentation fault\n") is None


def _fake_run(monkeypatch, result=None, exc=None):
    calls = []

    def run(cmd, **kw):
        calls.append((cmd, kw))
        if exc is not None:
            raise exc
        return subprocess.CompletedProcess(cmd, *result)

    monkeypatch.setattr(reference.subprocess, "run", run)
    return calls


def test_a_training_point_reads_the_childs_figures(tmp_path, monkeypatch):
    ref = _fake_reference(tmp_path, FAKE_LOADER)
    errs = dict(x=1e-3, w_gate=2e-3, w_up=3e-3, w_down=4e-3)
    line = json.dumps(dict(ref_ms=1.5, ref_mib=625.0, ref_grad_rel_err=4e-3, ref_grad_rel_errs=errs))
    calls = _fake_run(monkeypatch, (0, f"built\nREF {line}\n", ""))
    row = reference.run_train_point(ref, 16384, 2048, 5632, 0.005, 0.2, 77, reps=40, timeout=33)
    assert row == dict(ref_ms=1.5, ref_mib=625.0, ref_grad_rel_err=4e-3, ref_grad_rel_errs=errs, ref_status="ok")
    (cmd, kw), = calls
    assert cmd[1:] == ["-m", "benchmarks.reference", "--train", ref, "16384", "2048", "5632", "0.005", "0.2",
                       "77", "--reps", "40"]
    assert kw["timeout"] == 33 and kw["cwd"] == reference.ROOT


@pytest.mark.parametrize("rc, stdout, want", [
    (-11, "", "crashed rc=-11 (SIGSEGV): Segmentation fault"),
    (1, "", "crashed rc=1: Segmentation fault"),
    (0, "no figures\n", "crashed rc=0: Segmentation fault"),        # exited 0 without its line
    (1, 'REF {"ref_ms": 1.0}\n', "crashed rc=1: Segmentation fault"),  # a line, then died
])
def test_a_training_point_that_dies_is_recorded(tmp_path, monkeypatch, rc, stdout, want):
    ref = _fake_reference(tmp_path, FAKE_LOADER)
    _fake_run(monkeypatch, (rc, stdout, "lots of log\nSegmentation fault\n"))
    row = reference.run_train_point(ref, 64, 64, 160, 0.05, 0.0, 1)
    assert row["ref_status"] == want
    assert math.isnan(row["ref_ms"]) and math.isnan(row["ref_mib"]) and math.isnan(row["ref_grad_rel_err"])
    assert row["ref_grad_rel_errs"] is None


def test_a_training_point_past_its_timeout_is_recorded(tmp_path, monkeypatch):
    ref = _fake_reference(tmp_path, FAKE_LOADER)
    _fake_run(monkeypatch, exc=subprocess.TimeoutExpired(["python3"], 5))
    row = reference.run_train_point(ref, 64, 64, 160, 0.05, 0.0, 1, timeout=5)
    assert row["ref_status"] == "timeout" and math.isnan(row["ref_ms"])


def test_a_crashing_training_reference_gives_a_crashed_row(tmp_path):
    ref = _fake_reference(tmp_path, "import os\nos.abort()\n")       # dies as a segfault would
    row = reference.run_train_point(ref, 64, 64, 160, 0.05, 0.0, 1, reps=10, timeout=120)
    assert row["ref_status"].startswith("crashed rc=-6 (SIGABRT)"), row
    assert math.isnan(row["ref_ms"]) and math.isnan(row["ref_grad_rel_err"])


def test_the_training_child_runs_on_the_benchmarks_inputs(tmp_path):
    # the real child, on the CPU, with the stand-in op: its layout changes and error checks
    ref = _fake_reference(tmp_path, FAKE_LOADER)
    cmd = [sys.executable, "-m", "benchmarks.reference", "--train", ref, "64", "64", "160", "0.05", "0.2", "5",
           "--reps", "1", "--device", "cpu"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=reference.child_env(), cwd=reference.ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    row = reference.parse_line(r.stdout)
    errs = row["ref_grad_rel_errs"]
    assert list(errs) == list(reference.GRADS)
    # the stand-in is eager's bf16 arithmetic: eager's error (~4e-3), no more
    assert all(0 < e < 2e-2 for e in errs.values()), errs
    assert row["ref_grad_rel_err"] == max(errs.values())
    assert row["ref_ms"] > 0 and math.isnan(row["ref_mib"])          # no CUDA peak on the CPU


def _grid_args(ref: str, **kw):
    return argparse.Namespace(**dict(dict(no_inductor=True, reps=10, reference=ref, ref_timeout=7.0, activity="iid",
                                          act="relu", config=None), **kw))


def test_bench_ffn_train_rows_carry_the_reference(tmp_path, monkeypatch, capsys):
    ref = _fake_reference(tmp_path, FAKE_LOADER)
    built, asked = [], []
    inputs = bench_ffn_train.train_inputs

    def spy_inputs(*a):
        built.append(a[:6])
        return inputs(*a)

    def fake_point(ref_dir, m, k, n, d, t, seed, reps, timeout, activity):
        asked.append(((m, k, n, d, t, seed), ref_dir, reps, timeout, activity))
        if t > 0:
            return dict(ref_ms=float("nan"), ref_mib=float("nan"), ref_grad_rel_err=float("nan"),
                        ref_grad_rel_errs=None, ref_status="crashed rc=-11 (SIGSEGV): ")
        return dict(ref_ms=2.0, ref_mib=123.0, ref_grad_rel_err=5e-3,
                    ref_grad_rel_errs=dict(x=1e-3, w_gate=5e-3, w_up=2e-3, w_down=3e-3), ref_status="ok")

    monkeypatch.setattr(bench_ffn_train, "train_inputs", spy_inputs)
    monkeypatch.setattr(reference, "run_train_point", fake_point)
    out = tmp_path / "rows.json"
    rows = bench_ffn_train.grid(_grid_args(ref), [64], [0.05], [0.0, 0.2], 64, 160, bench_ffn_train.TwellConfig(),
                                bench_ffn_train.torch.device("cpu"), bench_ffn_train.torch.bfloat16, False, out)
    # the child is asked for exactly the points (and seeds) whose inputs the benchmark built
    assert [a[0] for a in asked] == built and len(built) == 2
    assert all(a[1:] == (ref, 10, 7.0, "iid") for a in asked)
    ok, crashed = rows
    assert (ok["ref_ms"], ok["ref_mib"], ok["ref_grad_rel_err"], ok["ref_status"]) == (2.0, 123.0, 5e-3, "ok")
    assert ok["ref_grad_rel_errs"]["w_gate"] == 5e-3
    assert ok["config"] == crashed["config"] == "record"          # no --config: the record's own launch sizes
    assert crashed["ref_status"].startswith("crashed") and math.isnan(crashed["ref_ms"])
    assert json.loads(out.read_text().replace("NaN", "null"))[1]["ref_status"] == crashed["ref_status"]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-5:] == ["ref", "x_ref", "r_MiB", "ref_err", "path"]
    dense_ms = ok["dense_ms"]
    assert f" {2.0:>7.3f} {dense_ms / 2.0:>6.2f} {123.0:>7.0f} {5e-3:>8.1e} " in lines[1]
    assert " crash " in lines[2] and "[reference crashed rc=-11 (SIGSEGV): ]" in lines[2]


def test_bench_ffn_train_without_the_reference_has_no_reference_columns(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(reference, "run_train_point", lambda *a: pytest.fail("no --reference: no child"))
    rows = bench_ffn_train.grid(_grid_args(None, config="wg_dy_entries=2"), [64], [0.05], [0.0], 64, 160,
                                bench_ffn_train.TwellConfig(), bench_ffn_train.torch.device("cpu"),
                                bench_ffn_train.torch.bfloat16, False, tmp_path / "rows.json")
    assert not any(key.startswith("ref_") for key in rows[0])
    assert rows[0]["config"] == "wg_dy_entries=2"          # --config's record fields name the row's launch sizes
    assert "ref" not in capsys.readouterr().out.splitlines()[0].split()


def test_bench_ffn_train_takes_a_profiles_activity(tmp_path, monkeypatch, capsys):
    """--activity PROFILE: the grid at the profile's density, each row naming the layer, and the
    reference's child asked for the same spec; a checkpoint (biases) is refused."""
    prof = str(bench_ffn_train.Path(__file__).resolve().parents[2] / "benchmarks" / "profiles" / "cpu_tiny_activity.json")
    out = tmp_path / "q.json"
    assert bench_ffn_train.main(["--quick", "--M", "64", "--activity", prof + ":1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text().replace("NaN", "null"))
    assert row["activity"] == prof + ":model.layers.1.mlp" and row["tail"] == 0.0
    assert 0 < row["density"] < 0.1 and row["grad_rel_err"] <= 2 * row["dense_grad_rel_err"] + 1e-6
    asked = []
    monkeypatch.setattr(reference, "run_train_point", lambda *a, activity: asked.append(activity) or dict(
        ref_ms=1.0, ref_mib=1.0, ref_grad_rel_err=1e-3, ref_grad_rel_errs={}, ref_status="ok"))
    bench_ffn_train.grid(_grid_args(_fake_reference(tmp_path, FAKE_LOADER), activity=row["activity"]), [64],
                         [row["density"]], [0.0], 64, 160, bench_ffn_train.TwellConfig(),
                         bench_ffn_train.torch.device("cpu"), bench_ffn_train.torch.bfloat16, False, tmp_path / "r.json")
    assert asked == [row["activity"]]
    with pytest.raises(SystemExit):
        bench_ffn_train.main(["--quick", "--activity", "checkpoint:/nonexistent.pt"])
    assert "no biases" in capsys.readouterr().err
