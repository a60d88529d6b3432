"""benchmarks/profile_product.py's inputs (the CPU part of a GPU-only tool): the modules it
compiles hold the point's weights under each --activity, and bad arguments are refused."""

from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks import profile_product
from twell_compile.reference import ffn_dense
from twell_compile.testing import make_ffn_for

PROFILE = "benchmarks/profiles/h100_activity.json:model.layers.3.mlp"


def _args(activity: str, non_gated: bool, layout: str = "linear") -> argparse.Namespace:
    return argparse.Namespace(activity=activity, M=64, K=128, N=512, density=0.05, tail=0.0,
                              non_gated=non_gated, down_layout=layout)


@pytest.mark.parametrize("activity", ["iid", PROFILE])
@pytest.mark.parametrize("non_gated", [False, True])
def test_the_modules_hold_the_points_weights_and_compute_its_ffn(activity, non_gated):
    a = _args(activity, non_gated, "transposed")
    x, mods = profile_product.modules(a, device="cpu")
    p = make_ffn_for(activity, 64, 128, 512, 0.05, 0.0, gated=not non_gated, device="cpu", seed=7)
    assert torch.equal(x, p["x"]) and len(mods) == 2 and mods[0] is not mods[1]
    for m in mods:
        assert torch.equal(m.gate.weight, p["w_gate"]) and torch.equal(m.down.weight, p["w_down"])
        assert m.down.weight.stride() == (1, 128)          # W_down [K_out, N] stored as [N, K_out] rows
        assert hasattr(m, "up") != non_gated
        with torch.no_grad():
            y = m(x)
        ref = ffn_dense(*(None if t is None else t.float() for t in (
            p["x"], p["w_gate"], p["b_gate"], p["w_up"], p["b_up"], p["w_down"], p["b_down"])))
        assert torch.allclose(y.float(), ref, rtol=3e-2, atol=3e-2)
    h = torch.relu(x.float() @ p["w_gate"].float().t())
    assert 0 < float((h > 0).float().mean()) < 0.5


def test_a_bad_activity_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        profile_product.main(["--activity", "nope.txt"])
    assert "want iid, PROFILE.json[:LAYER] or checkpoint:PATH" in capsys.readouterr().err
