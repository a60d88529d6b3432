"""Per-layer statistics: what layer_stats returns and prints, snapshot and restore."""

import dataclasses

import torch

import twell_compile
from twell_compile import stats


def _record(layer, counts, abs_sum, overflows=0, hidden=40):
    stats.record(layer, torch.tensor(counts), torch.tensor(float(abs_sum)), torch.tensor(overflows), hidden)


def test_layer_stats_is_a_dict_that_prints_as_a_table():
    twell_compile.reset_stats()
    assert str(twell_compile.layer_stats()).startswith("twell layer_stats: no rewritten FFN has run yet")
    _record("model.layers.1.mlp", [2, 4], 12.0, overflows=1)
    _record("model.layers.0.mlp", [1, 3, 5], 6.0)
    got = twell_compile.layer_stats()
    assert isinstance(got, dict) and list(got) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    s = got["model.layers.0.mlp"]
    assert (s.tokens, s.hidden, s.mean_nnz, s.max_nnz, s.overflows) == (3, 40, 3.0, 5, 0)
    assert s.l1 == 6.0 / (3 * 40) and s.density == 3.0 / 40
    lines = str(got).splitlines()
    assert lines[0] == "twell layer_stats: 2 layer(s), each from its latest call"
    assert lines[1].split() == ["layer", "tokens", "hidden", "mean", "nnz", "density", "max", "nnz", "mean", "|h|",
                                "overflows", "dead"]
    assert lines[3].split() == ["model.layers.0.mlp", "3", "40", "3.0", "7.50%", "5", "0.05", "0", "-"]
    assert lines[4].split() == ["model.layers.1.mlp", "2", "40", "3.0", "7.50%", "4", "0.15", "1", "-"]
    assert repr(got) == str(got)
    assert dict(got) == {k: got[k] for k in got}   # plain dict behaviour kept


def test_layer_stats_fields_are_documented_with_units():
    doc = stats.LayerStats.__doc__
    for f in dataclasses.fields(stats.LayerStats):
        assert f"\n    {f.name}: " in doc, f.name
    assert "density (property)" in doc and "count" in doc and "units of the hidden activation" in doc
    assert "LayerStats" in twell_compile.layer_stats.__doc__ and "table" in twell_compile.layer_stats.__doc__


def test_restore_undoes_every_record_since_snapshot():
    twell_compile.reset_stats()
    _record("a", [1, 2], 3.0)
    buffer = stats.reserve("a", "cpu")                        # the layer's buffer (held: no new one)
    saved = stats.snapshot()
    before = dict(twell_compile.layer_stats())
    _record("a", [7, 7, 7], 9.0, hidden=50)
    _record("b", [1], 1.0)
    stats.restore(saved)
    assert dict(twell_compile.layer_stats()) == before
    assert stats.reserve("a", "cpu") is buffer   # compiled graphs keep their buffer


def test_statistics_made_under_inference_mode_serve_calls_outside_it():
    """A layer's first call under torch.inference_mode() made its statistics buffer an inference
    tensor, and every later call outside inference mode failed its in-place update ("Inplace
    update to inference tensor outside InferenceMode"), other models' layers of the same name too."""
    from tests.passes.ffn_zoo import Spec, build

    def FFN():
        return build(Spec(k=16, n=40, k_out=16, bias=True)).train()

    options = {"twell.skip_dense": False, "twell.stats": True}
    x = torch.randn(3, 16)
    twell_compile.reset_stats()
    m = FFN()
    twell_compile.prepare(m, options=options)
    with torch.inference_mode():
        m(x)
    m(x).sum().backward()                       # a training call outside inference mode
    assert twell_compile.layer_stats()["root"].tokens == 3
    # compiled: train, eval under inference_mode, reset_stats, eval under inference_mode, train
    twell_compile.reset_stats()
    c = torch.compile(FFN(), backend="twell", options={**options, "twell.l1": 0.1})
    for step in ("train", "eval", "reset", "eval", "train"):
        if step == "reset":
            twell_compile.reset_stats()
        elif step == "eval":
            with torch.inference_mode():
                c(x)
        else:
            c(x).sum().backward()
    other = torch.compile(FFN(), backend="twell", options=options)   # same layer name, another model
    other(x).sum().backward()
    with torch.inference_mode():
        other(x)
    held = stats.snapshot()[0]                  # (copies; the buffers themselves through reserve)
    assert set(held) == {("root", torch.device("cpu"))}
    assert all(not stats.reserve(layer, dev).is_inference() for layer, dev in held)


def test_dead_units_are_those_silent_over_the_last_window_of_training_tokens():
    """record_fired stamps each unit that fired with the layer's token count; layer_stats counts
    the units whose stamp is older than the last DEAD_WINDOW tokens (units never fired included)."""
    twell_compile.reset_stats()
    n, w = 6, stats.DEAD_WINDOW
    _record("d", [1], 1.0, hidden=n)
    stats.record_fired("d", torch.tensor([True, True, False, False, False, False]), w // 2)
    s = twell_compile.layer_stats()["d"]
    assert (s.dead, s.dead_window) == (4, w // 2)          # within the first window: never fired is dead
    stats.record_fired("d", torch.tensor([False, True, True, False, False, False]), w // 2)
    assert twell_compile.layer_stats()["d"].dead == 3
    stats.record_fired("d", torch.tensor([False, False, False, True, False, False]), w // 2)
    s = twell_compile.layer_stats()["d"]
    # unit 0 last fired w tokens ago (outside the window), unit 1 and 2 w/2 ago, unit 3 now
    assert (s.dead, s.dead_window) == (3, w)
    assert str(twell_compile.layer_stats()).splitlines()[3].split()[-1] == "3"
    twell_compile.reset_stats()
    _record("i", [1], 1.0, hidden=n)                        # inference only: not tracked
    assert twell_compile.layer_stats()["i"].dead is None
