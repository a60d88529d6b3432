"""benchmarks/tune_gate.py: the fused gate against cuBLAS per configuration, rows in the shared
schema; every variant, cuBLAS's included, runs its own gate at every token count."""

from __future__ import annotations

import pytest
import torch

from benchmarks import tune_gate
from benchmarks.rows import load_rows
from twell_compile.runtime import arch


@pytest.mark.parametrize("cfg", [-1, 0, 4])
def test_each_variant_runs_its_own_gate_below_the_records_token_bound(cfg):
    # a record's gate_min_m (the H100's 16384) would send a 2048-token call to
    # cuBLAS whatever gate_cfg says: the "fused" forward timed cuBLAS's path below it
    with tune_gate.with_gate(cfg, 0, 1, 16):
        p = arch.launch_policy("cpu")
        assert (p.gate_cfg, p.gate_min_m, p.gate_slots) == (cfg, 0, 16)
    assert arch.launch_policy("cpu").gate_cfg == arch.cuda_default().gate_cfg


def test_rejects_an_unknown_configuration_before_anything_runs():
    with pytest.raises(ValueError, match="--configs"):
        tune_gate.main(["--configs", "99"])


@pytest.mark.gpu
def test_rows_per_variant_with_the_fused_path_exact(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused gate GEMM is sm90a")
    out = tmp_path / "g.json"
    tune_gate.main(["--M", "2048", "--K", "512", "--N", "1024", "--configs", "4", "--reps", "20",
                    "--rounds", "1", "--whole", "--out", str(out)])
    rows = load_rows(out)
    assert [r["variant"] for r in rows] == ["cublas", "cfg4/r0/s1"]
    assert all(r["forward_ms"] > 0 and r["err"] <= 2 * r["eager_err"] for r in rows)
