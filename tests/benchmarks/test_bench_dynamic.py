"""bench_dynamic.py on the CPU: --quick runs one compiled FFN across the (stood-in) token-count
rules, training and inference, and its flags are checked."""

import json

import pytest

from benchmarks import bench_dynamic


def _stand_ins():
    import torch

    from twell_compile.runtime import arch, execute, select
    return (execute.ffn_train_forward, execute.ffn_infer, arch.cuda_default(),
            select.static_path("cpu", torch.float32, 16, 16, 16, 16))   # CPU's rules again


@pytest.mark.parametrize("mode,ms,ran,compiles", [
    # training (rule: >= 32): 16 guarded to Inductor, 48 recompiles once (our op), 8 and 64
    # take the graphs already there
    ([], ["16", "48", "8", "64"], [False, True, False, True], [1, 2, 2, 2]),
    # inference (band 8 < M < 32): 16 (band: Inductor), 48 (per-row: op), 4 (decode-sized
    # without CUDA graphs: Inductor), 24 (the band's graph)
    (["--inference"], ["16", "48", "4", "24"], [False, True, False, False], [1, 2, 3, 3]),
])
def test_quick_runs_inductor_where_the_rules_say_and_our_op_elsewhere(tmp_path, mode, ms, ran, compiles):
    saved = _stand_ins()
    out = tmp_path / "t.json"
    assert bench_dynamic.main(["--quick", *mode, "--M", *ms, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["twell_op_ran"] for r in rows] == ran
    assert [r["twell_compiles"] for r in rows] == compiles
    assert all(r["inductor_compiles"] == 1 for r in rows)
    assert all(r["rel_err"] <= 2 * r["inductor_rel_err"] + 1e-6 for r in rows)
    assert all(r["gpu"].startswith("cpu: ") and r["commit"] and r["time"].endswith("Z") for r in rows)
    assert _stand_ins() == saved                      # put back


@pytest.mark.parametrize("argv,match", [
    (["--M", "0"], "--M"), (["--steps", "0"], "--steps"), (["--density", "0"], "--density"),
    (["--K", "-3"], "--K"),
])
def test_bad_flags_raise_naming_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        bench_dynamic.main([*argv, "--quick"])


def test_quick_keeps_the_shapes_given(tmp_path):
    out = tmp_path / "t.json"
    assert bench_dynamic.main(["--quick", "--inference", "--K", "48", "--N", "24", "--M", "8", "--out", str(out)]) == 0
    row, = json.loads(out.read_text())
    assert (row["M"], row["K"], row["N"]) == (8, 48, 24)
