"""twell_compile/testing.py: the synthetic FFN generator (anchors.md's recipe) and the replay
of a non-zeros-per-token profile, in the format examples/train_sparse_lm.py --profile-out
writes (a long-tailed one is made here; the measured ones live in benchmarks/profiles/)."""

import json

import pytest
import torch

from twell_compile.testing import load_profile, make_ffn, make_ffn_profile


@pytest.fixture
def profile_path(tmp_path):
    """Two layers; the denser one long-tailed: 75% of tokens with no non-zero of 4096, 1% over 100."""
    values = [0, 1, 2, 3, 4, 8, 16, 32, 64, 128, 256]
    counts = [6000, 500, 300, 200, 150, 300, 200, 150, 100, 70, 30]
    total = sum(counts)
    mean = sum(v * c for v, c in zip(values, counts)) / total
    cum, quantiles = 0, {}
    for q in (0.0, 0.5, 0.9, 0.99, 1.0):
        acc = 0
        for v, c in zip(values, counts):
            acc += c
            if acc >= q * total:
                quantiles[str(q)] = float(v)
                break
    dense = dict(hidden=4096, tokens=total, mean=mean, density=mean / 4096, quantiles=quantiles,
                 hist_values=values, hist_counts=counts)
    quiet = dict(dense, mean=0.1, density=0.1 / 4096, hist_values=[0, 1], hist_counts=[9000, 900],
                 quantiles={"0.0": 0.0, "0.5": 0.0, "0.9": 0.0, "0.99": 1.0, "1.0": 1.0})
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"layers": {"model.layers.0.mlp": quiet, "model.layers.1.mlp": dense}}))
    return path


def _nnz(p):
    return (torch.nn.functional.linear(p["x"].float(), p["w_gate"].float()) > 0).sum(-1).double()


@pytest.mark.parametrize("density", [0.005, 0.05, 0.3])
def test_anchor_generator_hits_the_density(density):
    p = make_ffn(2048, 256, 1024, density, dtype=torch.float32, device="cpu", seed=1)
    measured = _nnz(p).mean().item() / 1024
    assert measured == pytest.approx(density, rel=0.15)


def test_profile_replay_matches_the_measured_distribution(profile_path):
    name, prof = load_profile(str(profile_path))
    layers = json.load(open(profile_path))["layers"]
    assert name == "model.layers.1.mlp"
    assert prof["density"] == max(v["density"] for v in layers.values())  # the densest by default
    n = 4096
    p = make_ffn_profile(8192, 512, n, prof, dtype=torch.float32, device="cpu", seed=3)
    dens = _nnz(p) / n
    assert dens.mean().item() == pytest.approx(float(prof["density"]), rel=0.15)
    # The long tail carries over: the busiest 1% of tokens are many times the median.
    q = prof["quantiles"]
    want_ratio = float(q["0.99"]) / max(float(q["0.5"]), 1.0)
    got_ratio = dens.quantile(0.99).item() / max(dens.quantile(0.5).item(), 1.0 / n)
    assert got_ratio > 0.5 * want_ratio
    # Tokens with no active neuron appear about as often as in the profile.
    zero_frac = prof["hist_counts"][prof["hist_values"].index(0)] / sum(prof["hist_counts"])
    assert (dens == 0).double().mean().item() == pytest.approx(zero_frac, abs=0.1)


def test_unknown_profile_layer_is_named(profile_path):
    with pytest.raises(ValueError, match="not in"):
        load_profile(str(profile_path), "model.layers.99.mlp")
