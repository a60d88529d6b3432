"""benchmarks/probes/bench_floor.py's host parts on the CPU: the index lists it gathers by, and
the floors it derives from a point's times (the probe kernel, benchmarks/probes/gather_probe.cu,
is compile-checked by ``python3 -m twell_compile.build --check`` and run on the device)."""

import pytest
import torch

from benchmarks.probes import bench_floor
from twell_compile import build


@pytest.mark.parametrize("shuffle", [False, True])
def test_csr_lists_each_rows_columns(shuffle):
    a = torch.rand(37, 53, generator=torch.Generator().manual_seed(3)) < 0.2
    a[5] = False                                      # an empty row
    off, idx = bench_floor.csr(a, shuffle=shuffle, seed=1)
    assert off.dtype == idx.dtype == torch.int32 and off.numel() == 38 and int(off[-1]) == int(a.sum())
    for r in range(37):
        got = idx[off[r]:off[r + 1]]
        want = a[r].nonzero().flatten().int()
        assert torch.equal(got.sort().values, want)
        if not shuffle:
            assert torch.equal(got, want)
    if shuffle:                                       # some row is out of order
        assert any(not torch.equal(idx[off[r]:off[r + 1]], a[r].nonzero().flatten().int()) for r in range(37))


def test_floors_take_the_cheaper_of_gathering_and_dense_per_group():
    t = dict(gate=0.5, gemm_dx=0.6, gemm_wgrad=0.7, pairs=0.4, cols=0.3, cols_shuffled=0.45, cols_x_dy=0.7,
             eager_ffn=1.8, inductor_ffn=1.6, eager_train=5.0)
    f = bench_floor.floors(t, pairs=1000, row_bytes=8192)
    assert f["infer_floor_ms"] == pytest.approx(0.9) and f["infer_max_ratio"] == pytest.approx(1.6 / 0.9)
    assert f["train_floor_ms"] == pytest.approx(0.5 + 0.4 + 0.4 + 0.3 + 0.3)
    assert f["pair_gather_tb_s"] == pytest.approx(1000 * 8192 / 0.4 / 1e9)
    # where gathering costs more than the dense GEMMs, the floor takes the GEMMs
    t.update(pairs=2.0, cols=1.5, cols_shuffled=1.6)
    f = bench_floor.floors(t, pairs=1000, row_bytes=8192)
    assert f["train_floor_ms"] == pytest.approx(0.5 + 1.0 + 1.2 + 1.4 + 1.3)
    assert f["train_floor_sparse_ms"] == pytest.approx(0.5 + 2.0 + 2.0 + 1.5 + 1.5)
    del t["inductor_ffn"]                             # --no-inductor: eager's FFN is the dense time
    assert bench_floor.floors(t, 1000, 8192)["infer_dense_ms"] == 1.8


def test_the_probe_lives_with_the_benchmarks_and_builds_from_there():
    """The probe is no shipped source: build.sources finds it in benchmarks/probes/ only."""
    assert build.sources("gather_probe", build.PROBES) == [build.PROBES / "gather_probe.cu"]
    with pytest.raises(ValueError, match="no sources"):
        build.sources("gather_probe")
    assert build.sources("cpu_ffn") == [build.CSRC / "cpu_ffn.cpp"]


def test_load_builds_the_probe_from_its_directory(tmp_path, monkeypatch):
    """cpp_extension.load stubbed: the probe's source and a build directory of its own."""
    from torch.utils import cpp_extension

    asked = {}
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: asked.update(kw) or "module")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME or "/usr/local/cuda")
    assert build.load.__wrapped__("gather_probe", directory=build.PROBES) == "module"
    assert asked["sources"] == [str(build.PROBES / "gather_probe.cu")]
    assert build.build_directory("gather_probe", ["-O3"], build.PROBES) != build.build_directory("gather_probe", ["-O3"])
