"""bench_ffn.py --decode's host side on the CPU: flags rejected before any GPU work, the layer
count, and the configs / cost-model files it runs under (arch.patched)."""

import inspect
import json

import pytest

from benchmarks import bench_decode, bench_ffn
from twell_compile.runtime import arch, select


@pytest.mark.parametrize("argv,match", [
    (["--M", "0"], "--M"),
    (["--density", "0"], "--density"),
    (["--density", "1.5"], "--density"),
    (["--shapes", "2048"], "--shapes"),
    (["--shapes", "2048xabc"], "--shapes"),
    (["--kernels", "-1"], "--kernels"),
])
def test_bad_flags_raise_naming_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        bench_ffn.main(["--decode", *argv])


def test_layers_cover_more_than_the_l2():
    # K=2048, N=5632 gated: 69 MB of weights per layer -> 4 layers for 256 MB
    assert bench_decode.layers_for(2048, 5632, 2048, True, 256) == 4
    assert bench_decode.layers_for(4096, 11008, 4096, True, 256) == 2
    assert bench_decode.layers_for(64, 64, 64, True, 256) > 1000


def test_configs_file_sets_the_decode_configs(tmp_path):
    base = arch.cuda_default()
    path = tmp_path / "c.json"
    path.write_text('{"16": [16, 128, 64, 64, 2, 4096, 4, 3], "wide:16": [32, 64, 64, 64, 1, 0, 8, 2]}')
    changes = bench_decode.load_configs(str(path))
    with arch.patched(**changes):
        p = arch.cuda_default()
        assert p.decode_configs[16] == arch.DecodeConfig(16, 128, 64, 64, 2, 4096, 4, 3)
        assert p.wide_decode_configs[16] == arch.DecodeConfig(32, 64, 64, 64, 1, 0, 8, 2)
        assert p.wide_decode_configs[32] == base.wide_decode_configs[32]      # buckets not given: the record's
        assert p.decode_config(16, 2048) == p.decode_configs[16]
        assert p.decode_config(9, p.wide_k) == p.wide_decode_configs[16]
    assert arch.cuda_default() == base                                       # only inside the block


def test_policy_file_sets_the_cost_model(tmp_path):
    base = arch.cuda_default()
    rows = [9.0, 2000.0, 4.0, 0.25]
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"decode_forms": {"rows": rows}, "dense_fixed_us": 20.0, "dense_gbps": 3000.0}))
    with arch.patched(**bench_decode.load_policy(str(path))):
        p = arch.cuda_default()
        assert p.decode_forms["rows"] == tuple(rows) and p.decode_forms["pairs"] == base.decode_forms["pairs"]
        assert (p.dense_fixed_us, p.dense_gbps) == (20.0, 3000.0)
        assert select.dense_us(p, 2048, 5632, 2048, True) > select.dense_us(base, 2048, 5632, 2048, True)
    path.write_text(json.dumps({"decode_forms": {"rows": rows[:3]}}))
    with pytest.raises(ValueError, match="'rows' wants 4 constants"):
        bench_decode.load_policy(str(path))
    path.write_text(json.dumps({"DEC_ROWS_FIXED_US": 5.0}))
    with pytest.raises(ValueError, match="unknown fields"):
        bench_decode.load_policy(str(path))


def test_shipped_decode_configs_by_width():
    """The H200 record's decode configs (arch.py, 2026-11-22 to 2026-11-23): the pairs form at
    16 neurons per program, 2 pairs per trip and 2 warps up to 16 rows below wide_k (the list
    form keeps 32 neurons, 4 pairs, 4 warps), 32 neurons (4 pairs, 4 warps) above; 64 up to 16
    rows at and above wide_k; whole K_out per step except at K >= wide_k with 32+ rows."""
    p = arch.H200
    c16, c32 = p.decode_config(16, 2048), p.decode_config(32, 2048)
    assert (arch.pairs_bn(c16), arch.pairs_pb(c16), c16.pwarps, c16.koc) == (16, 2, 2, 2048)
    assert (c16.lbn, c16.pb, c16.warps) == (32, 4, 4)
    assert (arch.pairs_bn(c32), arch.pairs_pb(c32), c32.pwarps or c32.warps) == (32, 4, 4)
    assert p.decode_config(16, 4096).lbn == 64 and p.decode_config(32, 4096).koc == 1024
    assert p.decode_config(1, 4096).vec_m == p.decode_config(1, 2048).vec_m


def test_act_reaches_the_grid_and_unknown_ones_are_refused(monkeypatch, capsys):
    """--act (bench_ffn.py --decode --act relu2 / drelu) reaches the grid, which hands it to
    run_point (the op's, eager's and the reference's activation, the row's act); the grid needs a
    GPU, so it is stood in for here."""
    got = []
    monkeypatch.setattr(bench_decode.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_decode, "grid", lambda args, shapes: got.append(args.act) or 0)
    for act in ("relu", "relu2", "drelu"):
        assert bench_ffn.main(["--decode", "--act", act, "--M", "1"]) == 0
    assert got == ["relu", "relu2", "drelu"]
    with pytest.raises(SystemExit):
        bench_ffn.main(["--decode", "--act", "gelu"])
    assert "invalid choice" in capsys.readouterr().err
    assert "act" in inspect.signature(bench_decode.run_point).parameters


def test_forms_and_down_layout_reach_the_grid(monkeypatch, capsys):
    """--forms (the forms timed forced) and --down-layout (W_down's storage) reach the grid, which
    hands them to run_point and weight_sets; the grid needs a GPU, so it is stood in for here."""
    got = []
    monkeypatch.setattr(bench_decode.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_decode, "grid", lambda args, shapes: got.append((args.forms, args.down_layout)) or 0)
    assert bench_ffn.main(["--decode", "--M", "16"]) == 0
    assert bench_ffn.main(["--decode", "--forms", "pairs", "union", "--down-layout", "transposed"]) == 0
    assert bench_ffn.main(["--decode", "--forms", "pairs", "union2", "--down-layout", "transposed"]) == 0
    assert got == [(list(bench_decode.cuda_decode.FORMS), "linear"), (["pairs", "union"], "transposed"),
                   (["pairs", "union2"], "transposed")]
    assert "union" in bench_decode.cuda_decode.FORMS and "union2" in bench_decode.cuda_decode.FORMS
    for argv in (["--forms", "unions"], ["--down-layout", "column"]):
        with pytest.raises(SystemExit):
            bench_ffn.main(["--decode", *argv])
        assert "invalid choice" in capsys.readouterr().err
    assert "forms" in inspect.signature(bench_decode.run_point).parameters
    assert "down_layout" in inspect.signature(bench_decode.weight_sets).parameters


def test_configs_file_replaces_named_fields(tmp_path):
    """{padded M: {field: value}}: those fields replaced in the record's config (union-form sweeps)."""
    base = arch.cuda_default()
    path = tmp_path / "c.json"
    path.write_text('{"64": {"union_s": 8, "union_c": 32}, "wide:16": {"union_bo": 16}}')
    with arch.patched(**bench_decode.load_configs(str(path))):
        p = arch.cuda_default()
        assert p.decode_configs[64] == base.decode_configs[64]._replace(union_s=8, union_c=32)
        assert p.wide_decode_configs[16] == base.wide_decode_configs[16]._replace(union_bo=16)
        assert p.decode_configs[16] == base.decode_configs[16]
    path.write_text('{"64": {"union_splits": 8}}')
    with pytest.raises(ValueError, match="unknown DecodeConfig fields"):
        bench_decode.load_configs(str(path))
    path.write_text('{"48": {"union_s": 8}}')
    with pytest.raises(ValueError, match="padded M 48"):
        bench_decode.load_configs(str(path))


def test_per_call_us_sums_each_launch_over_steps_and_layers():
    """Device us per call by kernel name: phases are steps of all layers' calls; C++ signatures cut."""
    phases = [[("decode_union2_up_kernel", 6.0), ("void at::native::gemm<bf16>(int)", 10.0),
               ("decode_union2_up_kernel", 8.0)],
              [("decode_union2_up_kernel", 10.0), ("void at::native::gemm<bf16>(int)", 14.0)]]
    got = bench_decode.per_call_us(phases, per_phase=2)
    assert got == {"decode_union2_up_kernel": 24.0 / 4, "void at::native::gemm<bf16>": 24.0 / 4}
    with pytest.raises(ValueError, match="per_phase"):
        bench_decode.per_call_us(phases, per_phase=0)
