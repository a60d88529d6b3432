"""bench_train_dynamic.py on the CPU: --quick steps one compiled FFN across the (stood-in)
small-M rule, and its flags are checked."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_train_dynamic  # noqa: E402


def test_quick_runs_inductor_below_the_rule_and_our_op_above(tmp_path):
    from twell_compile import dispatch
    from twell_compile.kernels import cuda_train
    saved = (dispatch.ffn_train_forward, dispatch.static_dense_train_reason, cuda_train.MIN_TOKENS)
    out = tmp_path / "t.json"
    assert bench_train_dynamic.main(["--quick", "--M", "16", "48", "8", "64", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    # tokens 16 (< 32: guarded, Inductor's FFN), 48 (recompiles once: our op), 8 (the first
    # graph again), 64 (the second)
    assert [r["twell_op_ran"] for r in rows] == [False, True, False, True]
    assert [r["twell_compiles"] for r in rows] == [1, 2, 2, 2]
    assert all(r["inductor_compiles"] == 1 for r in rows)
    assert all(r["grad_rel_err"] <= 2 * r["inductor_grad_rel_err"] + 1e-6 for r in rows)
    # the stand-ins are put back
    assert (dispatch.ffn_train_forward, dispatch.static_dense_train_reason, cuda_train.MIN_TOKENS) == saved


@pytest.mark.parametrize("argv,match", [
    (["--M", "0"], "--M"), (["--steps", "0"], "--steps"), (["--density", "0"], "--density"),
    (["--K", "-3"], "--K"),
])
def test_bad_flags_raise_naming_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        bench_train_dynamic.main([*argv, "--quick"])
