"""benchmarks/activity_profile.py on the CPU: its statistics against a brute-force count on a
hand-made activity pattern, the script on bench_e2e's tiny model writing a profile and a
checkpoint that load back, and bench_ffn.py's --activity (specs, the reference's child)."""

import json
import math
import types

import pytest
import torch

from benchmarks import activity_profile as AP
from benchmarks import bench_ffn
from twell_compile.testing import load_activity_profile, load_checkpoint_ffn, make_ffn_activity


def pattern():
    """[2 sequences, 64 positions, 8 neurons]: 0 always on, 1 never (dead), 2 on at positions
    0-3, 3 on in runs of 8 in sequence 0, 4 on at even positions, 5-7 random at 10%."""
    a = torch.zeros(2, 64, 8, dtype=torch.bool)
    a[:, :, 0] = True
    a[:, :4, 2] = True
    a[0, 16:24, 3] = a[0, 40:48, 3] = True
    a[:, ::2, 4] = True
    a[:, :, 5:] = torch.rand(2, 64, 3, generator=torch.Generator().manual_seed(0)) < 0.1
    return a


def brute_p_next(a, lag, start, neurons):
    both = first = 0
    for s in range(a.shape[0]):
        for t in range(start, a.shape[1] - lag):
            for j in neurons:
                first += int(a[s, t, j])
                both += int(a[s, t, j] and a[s, t + lag, j])
    return both / max(first, 1)


def test_layer_statistics_match_a_brute_force_count():
    a = pattern()
    p = AP.layer_profile(a)
    t = 128
    counts = a.sum((0, 1))
    assert p["counts"] == counts.tolist() and p["counts"][:5] == [128, 0, 8, 16, 64]
    assert p["tokens"] == t and p["seq"] == 64 and p["sequences"] == 2 and p["hidden"] == 8
    assert p["dead_frac"] == 1 / 8
    assert p["density"] == pytest.approx(float(counts.sum()) / (t * 8))
    assert p["mean"] == pytest.approx(float(counts.sum()) / t)
    per_token = a.sum(-1).reshape(-1)
    vals, freq = per_token.unique(return_counts=True)
    assert p["hist_values"] == vals.tolist() and p["hist_counts"] == freq.tolist()
    assert p["quantiles"]["1.0"] == float(per_token.max()) and p["quantiles"]["0.0"] == float(per_token.min())
    # positions: buckets [0,1) [1,2) [2,4) [4,8) ... [32,64)
    assert p["position"]["edges"] == [0, 1, 2, 4, 8, 16, 32, 64]
    for (lo, hi), d in zip(zip(p["position"]["edges"], p["position"]["edges"][1:]), p["position"]["density"]):
        assert d == pytest.approx(float(a[:, lo:hi].double().mean()))
    assert p["position"]["density"][0] > p["position"]["density"][-1]       # neuron 2 fires only early
    # lags from position 16 (64 > 2 * 16), every lag under 48
    lag = p["lag"]
    assert lag["from"] == 16 and lag["lags"] == [1, 2, 4, 8, 16, 32]
    for k, got in zip(lag["lags"], lag["p_next"]):
        assert got == pytest.approx(brute_p_next(a, k, 16, range(8)))
    late = a[:, 16:].double().mean((0, 1))
    assert lag["p_independent"] == pytest.approx(float((late ** 2).sum() / late.sum()))
    # by rate: the 7 live neurons sorted by count (stable) in groups of 1 (8 groups asked, 7 live)
    order = [j for j in sorted(range(8), key=lambda j: int(counts[j])) if counts[j] > 0]
    by = p["lag_by_rate"]
    assert len(by["rate"]) == len(by["p_next"]) == 7
    for j, rate, row in zip(order, by["rate"], by["p_next"]):
        assert rate == pytest.approx(int(counts[j]) / t)
        assert row == pytest.approx([brute_p_next(a, k, 16, [j]) for k in lag["lags"]])
    assert by["p_next"][order.index(4)][0] == 0.0 and by["p_next"][order.index(4)][1] == 1.0   # even positions
    tok = a[:, 16:].sum(-1).double().reshape(-1)
    assert p["token_cv"] == pytest.approx(float(tok.std() / tok.mean()))
    # co-activation: the 7 live neurons (top_k = 64 > 7); neuron 0 (constant) has no correlation
    co = p["coactivation"]
    assert co["top_k"] == 7
    cols = a.reshape(t, 8)[:, [2, 3, 4, 5, 6, 7]].double().T
    c = torch.corrcoef(cols)
    assert co["mean_corr_top"] == pytest.approx(float((c.sum() - c.diagonal().sum()) / 30), abs=1e-9)
    top = counts.double().sort(descending=True).values
    assert p["skew"]["top10_share"] == pytest.approx(float(top[0] / top.sum()))
    assert p["skew"]["max_over_mean"] == pytest.approx(float(top[0] / top.mean()))


def test_nothing_active_is_refused():
    with pytest.raises(ValueError, match="no neuron fired"):
        AP.layer_profile(torch.zeros(1, 8, 4, dtype=torch.bool))


def test_dump_keeps_number_lists_on_one_line():
    text = AP.dump({"a": [1, 2, 3], "b": {"c": [0.5, -1e-05]}, "d": "x"})
    assert "[1, 2, 3]" in text and "[0.5, -1e-05]" in text
    assert json.loads(text) == {"a": [1, 2, 3], "b": {"c": [0.5, -1e-05]}, "d": "x"}


pytest.importorskip("transformers")
TINY = ["--tiny", "--device", "cpu", "--batch", "2", "--seq", "64", "--calib-batch", "8", "--density", "0.1"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = tmp_path_factory.mktemp("activity")
    out, ck = d / "profile.json", d / "ck.pt"
    assert AP.main([*TINY, "--steps", "0", "--tokens", "256", "--out", str(out), "--checkpoint-out", str(ck),
                    "--layer", "1"]) == 0
    return out, ck


def test_the_script_writes_a_profile_that_loads_back(written):
    out, _ = written
    data = json.loads(out.read_text())
    assert data["format"] == "twell-activity/1" and data["model"]["ffn"] == 176 and data["train"]["steps"] == 0
    assert sorted(data["layers"]) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    for name in data["layers"]:
        got, layer = load_activity_profile(str(out), name)
        assert got == name and layer["tokens"] == 256 and layer["seq"] == 64 and layer["sequences"] == 4
        assert len(layer["counts"]) == 176 and sum(layer["counts"]) > 0
        # calibrated to 0.1 on other sequences: near it here
        assert 0.05 < layer["density"] < 0.2
        p = make_ffn_activity(256, 32, 176, layer, seq=64, dtype=torch.float32, device="cpu", seed=0)
        assert (torch.nn.functional.linear(p["x"], p["w_gate"]) > 0).double().mean().item() == pytest.approx(
            layer["density"], rel=0.01)


def test_the_checkpoint_holds_the_layers_real_inputs(written):
    out, ck_path = written
    ck = torch.load(ck_path, weights_only=True)
    assert ck["layer"] == "model.layers.1.mlp" and ck["x"].shape == (256, 64) and ck["x"].dtype == torch.bfloat16
    assert ck["x"].abs().sum() > 0 and ck["b_gate"] is not None
    p = load_checkpoint_ffn(str(ck_path), 256, "cpu", torch.float32)
    fired = (torch.nn.functional.linear(p["x"], p["w_gate"], p["b_gate"]) > 0).double().mean().item()
    assert fired == pytest.approx(ck["density"], abs=1e-9)
    # the same tokens the profile measured (in fp32 there, bf16 here): the same density, about
    layer = json.loads(out.read_text())["layers"]["model.layers.1.mlp"]
    assert fired == pytest.approx(layer["density"], rel=0.1)


def test_bad_layer_for_the_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--layer"):
        AP.main([*TINY, "--steps", "0", "--tokens", "64", "--out", str(tmp_path / "p.json"),
                 "--checkpoint-out", str(tmp_path / "c.pt"), "--layer", "7"])


@pytest.mark.slow
def test_the_script_trains_under_twell_with_the_penalty(tmp_path):
    out = tmp_path / "p.json"
    assert AP.main([*TINY, "--steps", "2", "--tokens", "128", "--twell-opt", "twell.l1=12", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["train"]["steps"] == 2 and data["train"]["twell_options"] == {"twell.l1": 12}
    assert all(load_activity_profile(str(out), name)[1]["density"] > 0 for name in data["layers"])


# ----------------------------------------------------------------------------- bench_ffn.py --activity

def test_bench_ffn_resolves_activity_specs(written):
    out, ck = written
    assert bench_ffn.resolve_activity("iid")["spec"] == "iid"
    act = bench_ffn.resolve_activity(str(out))
    layers = json.loads(out.read_text())["layers"]
    sparsest = min(layers, key=lambda k: layers[k]["density"])
    assert act["spec"] == f"{out}:{sparsest}" and not act["bias"]
    assert act["density"] == pytest.approx(layers[sparsest]["density"], rel=1e-3)       # 4 digits
    assert bench_ffn.resolve_activity(f"{out}:0")["spec"] == f"{out}:model.layers.0.mlp"
    assert "model.layers.0.mlp" in bench_ffn.resolve_activity(f"{out}:0")["label"]
    act = bench_ffn.resolve_activity(f"checkpoint:{ck}")
    assert (act["k"], act["n"], act["bias"]) == (64, 176, True) and act["spec"] == f"checkpoint:{ck}"
    assert math.isfinite(act["density"]) and "biases" in act["label"]
    for bad in ("uniform", f"{out}:9", "checkpoint:/nonexistent.pt"):
        with pytest.raises(ValueError):
            bench_ffn.resolve_activity(bad)


def test_bench_ffn_refuses_two_replays(written):
    out, _ = written
    with pytest.raises(SystemExit):
        bench_ffn.main(["--activity", str(out), "--nnz-profile", str(out), "--M", "16"])


def test_bench_ffn_module_takes_biases_for_a_checkpoint():
    assert bench_ffn.ffn_module(8, 16, False).gate.bias is None
    mod = bench_ffn.ffn_module(8, 16, True)
    assert mod.gate.bias.shape == (16,) and mod.down.bias.shape == (8,)
    assert mod(torch.randn(3, 8)).shape == (3, 8)


@pytest.fixture
def stand_in(tmp_path):
    """A reference folder whose twell module reports the child's arguments (its activity spec)."""
    mod = tmp_path / "custom_models" / "twell_modules"
    mod.mkdir(parents=True)
    (mod / "twell.py").write_text("import sys\na = sys.argv\n"
                                  "raise SystemExit('activity=' + (a[a.index('--activity') + 1] if '--activity' in a else 'none'))\n")
    return tmp_path


def test_reference_child_gets_the_activity_spec(stand_in, written):
    out, _ = written
    args = types.SimpleNamespace(reference=str(stand_in), reps=10, rounds=1, ref_timeout=120,
                                 activity=f"{out}:model.layers.0.mlp")
    row = bench_ffn.reference_point(args, 64, 64, 176, 0.1, 0.0, 3, bias=False)
    assert row["ref_status"].startswith("crashed rc=1") and row["ref_status"].endswith(f"activity={out}:model.layers.0.mlp")
    assert math.isnan(row["ref_ms"])
    # iid: the child's default (make_ffn's inputs), no --activity passed
    row = bench_ffn.reference_point(types.SimpleNamespace(**dict(vars(args), activity="iid")), 64, 64, 176, 0.1, 0.0, 3,
                                    bias=False)
    assert row["ref_status"].endswith("activity=none")
    row = bench_ffn.reference_point(args, 64, 64, 176, 0.1, 0.0, 3, bias=True)
    assert row["ref_status"].startswith("skipped") and math.isnan(row["ref_ms"])
