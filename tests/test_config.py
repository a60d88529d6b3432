import dataclasses

import pytest

from twell_compile.config import TwellConfig


def test_defaults_are_documented_and_frozen():
    c = TwellConfig()
    for f in dataclasses.fields(c):
        assert f"{f.name} [" in TwellConfig.__doc__, f"option {f.name} lacks a documented default"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.l1 = 1.0


def test_from_options_splits_ours_from_inductors():
    c, rest = TwellConfig.from_options({"twell.l1": 2e-5, "twell.tile_n": 64, "max_autotune": True})
    assert c.l1 == 2e-5 and c.tile_n == 64
    assert rest == {"max_autotune": True}


def test_int_accepted_for_float():
    assert TwellConfig.from_options({"twell.l1": 1})[0].l1 == 1.0


@pytest.mark.parametrize("options, err, match", [
    ({"twell.l2": 1.0}, ValueError, "unknown twell option 'twell.l2'"),
    ({"twell.l1": -1.0}, ValueError, "twell.l1"),
    ({"twell.l1": float("nan")}, ValueError, "twell.l1 must be a finite number"),
    ({"twell.l1": float("inf")}, ValueError, "twell.l1 must be a finite number"),
    ({"twell.l1": "big"}, TypeError, "twell.l1"),
    ({"twell.tile_n": 0}, ValueError, "twell.tile_n"),
    ({"twell.tile_n": 8, "twell.slots": 9}, ValueError, "twell.slots"),
    ({"twell.stats": 1}, TypeError, "twell.stats"),
    ({"twell.ell_width": True}, TypeError, "twell.ell_width"),
    ({"twell.backup_rows": 0}, ValueError, "twell.backup_rows"),
    ({"twell.cudagraphs": "yes"}, ValueError, "twell.cudagraphs"),
    ({"twell.cudagraphs": True}, TypeError, "twell.cudagraphs"),
])
def test_bad_options_raise_naming_the_option(options, err, match):
    with pytest.raises(err, match=match):
        TwellConfig.from_options(options)


def test_options_must_be_a_mapping():
    with pytest.raises(TypeError, match="options"):
        TwellConfig.from_options([("twell.l1", 1.0)])


def test_cache_tag_changes_with_every_option():
    base = TwellConfig().cache_tag()
    assert TwellConfig(l1=1e-5).cache_tag() != base
    assert TwellConfig(ell_width=7).cache_tag() != base


def test_non_finite_l1_is_refused_by_compile_and_prepare():
    """A NaN or Inf L1 coefficient would make every gradient NaN: refused up front."""
    import torch

    import twell_compile

    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    with pytest.raises(ValueError, match="twell.l1"):
        twell_compile.prepare(net, options={"twell.l1": float("nan")})
    with pytest.raises(Exception, match="twell.l1 must be a finite number"):
        torch.compile(net, backend="twell", options={"twell.l1": float("inf")})(torch.randn(2, 8))
