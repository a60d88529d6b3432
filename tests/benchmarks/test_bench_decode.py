"""bench_ffn.py --decode argument handling on the CPU (no GPU needed to reject bad flags)."""

import sys
from pathlib import Path

import pytest

from benchmarks import bench_decode  # noqa: E402
from benchmarks import bench_ffn  # noqa: E402


@pytest.mark.parametrize("argv,match", [
    (["--M", "0"], "--M"),
    (["--density", "0"], "--density"),
    (["--density", "1.5"], "--density"),
    (["--shapes", "2048"], "--shapes"),
    (["--shapes", "2048xabc"], "--shapes"),
])
def test_bad_flags_raise_naming_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        bench_ffn.main(["--decode", *argv])


def test_layers_cover_more_than_the_l2():
    # K=2048, N=5632 gated: 69 MB of weights per layer -> 4 layers for 256 MB
    assert bench_decode.layers_for(2048, 5632, 2048, True, 256) == 4
    assert bench_decode.layers_for(4096, 11008, 4096, True, 256) == 2
    assert bench_decode.layers_for(64, 64, 64, True, 256) > 1000


def test_configs_file_sets_the_decode_configs(tmp_path, monkeypatch):
    from twell_compile.kernels import cuda_decode
    monkeypatch.setattr(cuda_decode, "CONFIGS", dict(cuda_decode.CONFIGS))
    monkeypatch.setattr(cuda_decode, "WIDE_CONFIGS", dict(cuda_decode.WIDE_CONFIGS))
    wide = cuda_decode.WIDE_CONFIGS[32]
    path = tmp_path / "c.json"
    path.write_text('{"16": [16, 128, 64, 64, 2, 4096, 4, 3], "wide:16": [32, 64, 64, 64, 1, 0, 8, 2]}')
    bench_decode.load_configs(str(path))
    assert cuda_decode.CONFIGS[16] == cuda_decode.Config(16, 128, 64, 64, 2, 4096, 4, 3)
    assert cuda_decode.WIDE_CONFIGS[16] == cuda_decode.Config(32, 64, 64, 64, 1, 0, 8, 2)
    assert cuda_decode.WIDE_CONFIGS[32] == wide
    assert cuda_decode.config_for(16, 2048) == cuda_decode.CONFIGS[16]
    assert cuda_decode.config_for(9, cuda_decode.WIDE_K) == cuda_decode.WIDE_CONFIGS[16]


def test_shipped_decode_configs_by_width():
    """Session 14's sweep: the pairs form at 16 neurons per program, 2 pairs per trip and 2 warps
    up to 16 rows below WIDE_K (the list form keeps session 9's 32 neurons, 4 pairs, 4 warps),
    32 neurons (4 pairs, 4 warps) above; session 9's: 64 up to 16 rows at and above WIDE_K;
    whole K_out per step except at K >= WIDE_K with 32+ rows."""
    from twell_compile.kernels import cuda_decode
    c16, c32 = cuda_decode.config_for(16, 2048), cuda_decode.config_for(32, 2048)
    assert (cuda_decode.pairs_bn(c16), cuda_decode.pairs_pb(c16), c16.pwarps, c16.koc) == (16, 2, 2, 2048)
    assert (c16.lbn, c16.pb, c16.warps) == (32, 4, 4)
    assert (cuda_decode.pairs_bn(c32), cuda_decode.pairs_pb(c32), c32.pwarps or c32.warps) == (32, 4, 4)
    assert cuda_decode.config_for(16, 4096).lbn == 64 and cuda_decode.config_for(32, 4096).koc == 1024
    assert cuda_decode.config_for(1, 4096).vec_m == cuda_decode.config_for(1, 2048).vec_m


def test_shipped_decode_rule_constants_are_the_fit_of_the_committed_grid():
    """cuda_policy's decode-rule constants come from the committed H200 grid (no GPU needed)."""
    import tune_decode
    from twell_compile.kernels import cuda_policy
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200" / "ffn_decode.json"
    fit = tune_decode.fit_from_bench(str(path))
    for name, value in fit.items():
        assert getattr(cuda_policy, name) == pytest.approx(value, rel=2e-3), name
