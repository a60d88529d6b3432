"""The synthetic FFN generator: anchors.md's recipe, and replay of a measured profile."""

import sys
from pathlib import Path

import pytest
import torch

from twell_compile.testing import load_profile, make_ffn, make_ffn_profile  # noqa: E402

PROFILE = Path(__file__).resolve().parents[2] / "docs" / "gpu_run_h200" / "nnz_profile.json"


def _nnz(p):
    return (torch.nn.functional.linear(p["x"].float(), p["w_gate"].float()) > 0).sum(-1).double()


@pytest.mark.parametrize("density", [0.005, 0.05, 0.3])
def test_anchor_generator_hits_the_density(density):
    p = make_ffn(2048, 256, 1024, density, dtype=torch.float32, device="cpu", seed=1)
    measured = _nnz(p).mean().item() / 1024
    assert measured == pytest.approx(density, rel=0.15)


def test_profile_replay_matches_the_measured_distribution():
    import json

    name, prof = load_profile(str(PROFILE))
    layers = json.load(open(PROFILE))["layers"]
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


def test_unknown_profile_layer_is_named():
    with pytest.raises(ValueError, match="not in"):
        load_profile(str(PROFILE), "model.layers.99.mlp")
