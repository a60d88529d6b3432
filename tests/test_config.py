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
    c, rest = TwellConfig.from_options({"twell.l1": 2e-5, "twell.ell_width": 64, "max_autotune": True})
    assert c.l1 == 2e-5 and c.ell_width == 64
    assert rest == {"max_autotune": True}


def test_int_accepted_for_float():
    assert TwellConfig.from_options({"twell.l1": 1})[0].l1 == 1.0


@pytest.mark.parametrize("options, err, match", [
    ({"twell.l2": 1.0}, ValueError, "unknown twell option 'twell.l2'"),
    ({"twell.l1": -1.0}, ValueError, "twell.l1"),
    ({"twell.l1": float("nan")}, ValueError, "twell.l1 must be a finite number"),
    ({"twell.l1": float("inf")}, ValueError, "twell.l1 must be a finite number"),
    ({"twell.l1": "big"}, TypeError, "twell.l1"),
    ({"twell.ell_width": 0}, ValueError, "twell.ell_width"),
    ({"twell.path": "fast"}, ValueError, "twell.path must be one of"),
    ({"twell.path": 1}, TypeError, "twell.path"),
    ({"twell.tile_n": 64}, ValueError, "unknown twell option 'twell.tile_n'"),     # the removed tile path's
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
    assert TwellConfig(path="dense").cache_tag() != base


def test_non_finite_l1_is_refused_by_compile_and_prepare():
    """A NaN or Inf L1 coefficient would make every gradient NaN: refused up front."""
    import torch

    import twell_compile

    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    with pytest.raises(ValueError, match="twell.l1"):
        twell_compile.prepare(net, options={"twell.l1": float("nan")})
    with pytest.raises(Exception, match="twell.l1 must be a finite number"):
        torch.compile(net, backend="twell", options={"twell.l1": float("inf")})(torch.randn(2, 8))


@pytest.mark.parametrize("key, suggestion", [("twell.l2", "twell.l1"), ("twell.l1_layer", "twell.l1_layers"),
                                             ("twell.ell_widht", "twell.ell_width"), ("twell.Path", "twell.path")])
def test_unknown_twell_option_suggests_the_closest(key, suggestion):
    with pytest.raises(ValueError, match=rf"unknown twell option '{key}' \(did you mean '{suggestion}'\?\)"):
        TwellConfig.from_options({key: 1})


@pytest.mark.parametrize("key, suggestion", [("l1", "twell.l1"), ("twel.l1", "twell.l1"),
                                             ("max_autotun", "max_autotune")])
def test_check_options_validates_every_key_up_front(key, suggestion):
    import twell_compile

    with pytest.raises(ValueError, match=rf"unknown option '{key}'.*\(did you mean '{suggestion}'\?\)"):
        twell_compile.check_options({key: True})


def test_check_options_returns_the_config_and_checks_the_mode():
    import twell_compile

    assert "check_options" in twell_compile.__all__
    c = twell_compile.check_options({"twell.l1": 3.0, "epilogue_fusion": False})
    assert isinstance(c, TwellConfig) and c.l1 == 3.0
    with pytest.raises(ValueError, match="unknown torch.compile mode 'max-autotun'"):
        twell_compile.check_options({"twell.mode": "max-autotun"})
    with pytest.raises(TypeError, match="twell.stats must be bool"):
        twell_compile.check_options({"twell.stats": 1})


@pytest.mark.parametrize("options", [{"twell.l11": 1.0}, {"l1": 1.0}])
def test_backend_raises_the_check_options_message_at_compile_time(options):
    import torch

    import twell_compile

    with pytest.raises(ValueError) as up_front:
        twell_compile.check_options(options)
    assert "did you mean 'twell.l1'?" in str(up_front.value)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    with pytest.raises(Exception) as at_compile:
        torch.compile(net, backend="twell", options=options)(torch.randn(2, 8))
    assert str(up_front.value) in str(at_compile.value)


def test_l1_help_states_the_papers_setting_and_the_recipes_value():
    doc = " ".join(TwellConfig.__doc__.split())
    assert "recommends" not in doc
    assert "2e-5 is the paper's value for 10-40B tokens of pretraining at 0.5-2B parameters" in doc
    assert "recipe uses 3.0" in doc and 'docs/training.md "Choosing L1"' in doc and "kills neurons" in doc


def test_the_readmes_l1_sparsifies_a_short_run_where_the_papers_value_does_not():
    """README "Getting a sparse model: how much L1": over 30 steps 2e-5 leaves the density where no penalty does,
    3.0 halves it (a 32 -> 128 -> 32 gated FFN, Adam, CPU: ~55% -> ~25% of units active)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from twell_compile.testing import GatedMLP

    def density_after(l1: float) -> float:
        torch.manual_seed(0)
        torch._dynamo.reset()
        net, teacher = GatedMLP(32, 128, bias=True), nn.Linear(32, 32)
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        f = torch.compile(net, backend="twell", options={"twell.l1": l1})
        for _ in range(30):
            x = torch.randn(64, 32)
            loss = (f(x) - teacher(x).detach()).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            return (F.relu(net.gate(torch.randn(256, 32))) > 0).float().mean().item()

    none, paper, readme = density_after(0.0), density_after(2e-5), density_after(3.0)
    assert abs(paper - none) < 0.02 and none > 0.4
    assert readme < 0.6 * paper


def test_a_path_one_op_lacks_leaves_that_op_on_auto():
    assert TwellConfig(path="cpu").path_for(False) == "cpu" and TwellConfig(path="cpu").path_for(True) == "auto"
    assert TwellConfig(path="compact").path_for(False) == "auto" and TwellConfig(path="compact").path_for(True) == "compact"
    assert TwellConfig(path="twell").path_for(True) == TwellConfig(path="twell").path_for(False) == "twell"
