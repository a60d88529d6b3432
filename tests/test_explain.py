"""explain: its signature (options= versus the model's keywords), the mode it states, the error
when the model call fails, and no Dynamo or statistics state left behind."""

import contextlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import twell_compile
from twell_compile.testing import Block, PlainMLP

K, N, VOCAB = 16, 40, 50
FORCE = {"twell.skip_dense": False}   # rewrite these tiny CPU FFNs whatever the speed rule says


def mlp() -> PlainMLP:
    return PlainMLP(K, N, bias=True)


@contextlib.contextmanager
def scope():
    yield


class LM(nn.Module):
    """Token ids in; a graph break inside a user context manager (as HF models' output
    capturing has) makes Dynamo give up on the whole forward frame, not just split it."""

    def __init__(self, layers=2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, K)
        self.layers = nn.ModuleList(Block(mlp(), K) for _ in range(layers))

    def forward(self, ids, position_ids=None, **extra):
        with scope():
            x = self.emb(ids)
            if position_ids is not None:
                x = x + position_ids.unsqueeze(-1).to(x.dtype)
            for block in self.layers:
                x = block(x)
        return x


def ids(batch=2, seq=5):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))


def report_key(report):
    return report.graphs, [(r.layer, r.op, r.graph) for r in report.rewrites], [r.layer for r in report.rejections]


# ------------------------------------------------------------------------------ mode
def test_report_states_the_mode_it_assumed_and_how_to_get_the_other():
    model = LM()
    training = twell_compile.explain(model, ids(), options=FORCE)
    assert training.mode == "training"
    assert "mode: training" in str(training) and "torch.no_grad()" in str(training)
    with torch.no_grad():
        inference = twell_compile.explain(model, ids(), options=FORCE)
    assert inference.mode == "inference"
    assert [r.op for r in inference.rewrites] == ["twell::ffn"] * 2
    assert "mode: inference" in str(inference) and "requires_grad=True" in str(inference)
    with torch.inference_mode():
        assert twell_compile.explain(model, ids(), options=FORCE).mode == "inference"


# ------------------------------------------------------------------------------ signature
@pytest.mark.parametrize("key", ["opts", "option", "optons", "Options"])
def test_misspelled_options_keyword_raises_did_you_mean(key):
    calls = []

    class Spy(LM):
        def forward(self, ids, position_ids=None, **extra):
            calls.append(extra)
            return super().forward(ids, position_ids)

    with pytest.raises(TypeError, match=rf"unexpected keyword '{key}' \(did you mean 'options'\?\)"):
        twell_compile.explain(Spy(), ids(), **{key: FORCE})
    assert not calls   # refused before the model ran


def test_twell_key_as_keyword_raises():
    with pytest.raises(TypeError, match=r"options=\{'twell.l1': \.\.\.\}"):
        twell_compile.explain(LM(), ids(), **{"twell.l1": 1.0})


def test_a_keyword_the_model_names_reaches_it_even_if_it_looks_like_options():
    """position_ids is near 'options' by difflib's ratio (0.63) and opts nearer: both reach a
    model whose forward names them; opts into a bare **kwargs is refused."""
    seen = {}

    class Named(LM):
        def forward(self, ids, position_ids=None, opts=None, **extra):
            seen.update(position_ids=position_ids, opts=opts, extra=extra)
            return super().forward(ids, position_ids)

    pos = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        report = twell_compile.explain(Named(), ids(), position_ids=pos, opts="mine", flag=True, options=FORCE)
    assert seen["position_ids"] is not None and seen["opts"] == "mine" and seen["extra"] == {"flag": True}
    assert len(report.rewrites) == 2
    with pytest.raises(TypeError, match="did you mean 'options'"):
        twell_compile.explain(LM(), ids(), position_ids=pos, opts="lost in **extra")


def test_options_are_validated_with_did_you_mean():
    with pytest.raises(ValueError, match=r"did you mean 'twell.l1'\?"):
        twell_compile.explain(LM(), ids(), options={"twell.l2": 1.0})


# ------------------------------------------------------------------------------ failures
def test_failed_model_call_names_what_explain_passed():
    with pytest.raises(RuntimeError) as info:
        twell_compile.explain(LM(), (ids(),))
    msg = str(info.value)
    assert "explain called model(*args, **kwargs) with args=(tuple(Tensor[2, 5] int64),), kwargs={}" in msg
    assert "raised TypeError: embedding()" in msg
    assert "pass the inputs as separate arguments" in msg
    assert isinstance(info.value.__cause__, TypeError)


def test_failed_explain_leaves_no_state_behind():
    """The failed call made Dynamo skip LM.forward for good: the next report compiled each
    Block alone (1 FFN named 'mlp'). Now it equals a report made in a fresh process state."""
    model = LM()
    with torch.no_grad():
        alone = twell_compile.explain(model, ids(), options=FORCE)
        torch._dynamo.reset()
        twell_compile.reset_stats()
        with pytest.raises(Exception):   # the message: test_failed_model_call_names_what_explain_passed
            twell_compile.explain(model, (ids(),), options=FORCE)
        after = twell_compile.explain(model, ids(), options=FORCE)
    assert report_key(after) == report_key(alone)
    assert [r.layer for r in after.rewrites] == ["layers.0.mlp", "layers.1.mlp"]


def test_failed_explain_restores_earlier_stats():
    """The FFNs run (and record layer_stats for 9 tokens), then the model raises."""

    class FailsLate(LM):
        def forward(self, ids, position_ids=None, **extra):
            x = super().forward(ids)
            if bool(x.isfinite().all()):   # data-dependent: a graph break, then eager raises
                raise ValueError("after the FFNs ran")
            return x

    model = FailsLate()
    with torch.no_grad():
        twell_compile.explain(LM(), ids(), options=FORCE)
        before = dict(twell_compile.layer_stats())
        assert {s.tokens for s in before.values()} == {10}
        with pytest.raises(Exception, match="after the FFNs ran"):
            twell_compile.explain(model, ids(1, 9), options=FORCE)
    assert dict(twell_compile.layer_stats()) == before


def test_repeated_explain_does_not_drift_into_the_recompile_limit():
    """Each explain used to leave one cache entry on LM.forward: the 9th hit recompile_limit (8)
    and reported 0 graphs."""
    model = LM()
    with torch.no_grad():
        keys = [report_key(twell_compile.explain(model, ids(), options=FORCE)) for _ in range(10)]
    assert keys == [keys[0]] * 10 and keys[0][0] >= 1
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    assert _debug_get_cache_entry_list(LM.forward.__code__) == []


def test_explain_after_torch_compile_warns_and_the_compiled_model_still_runs():
    """Dynamo caches per code object (shared by every LM instance): explain's entries can only
    go with the other compile's on the same code, which then recompiles."""
    model = LM()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            twell_compile.explain(model, ids(), options=FORCE)   # nothing compiled before: no warning
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(1)
        return gm.forward

    compiled = torch.compile(model, backend=counting)
    with torch.no_grad():
        want = compiled(ids())
        with pytest.warns(RuntimeWarning, match="recompiles at its next call"):
            twell_compile.explain(model, ids(), options=FORCE)
        n = len(compiles)
        torch.testing.assert_close(compiled(ids()), want)
    assert len(compiles) > n   # dropped with explain's entries, compiled again


# ------------------------------------------------------------------------------ layer names
class SiluMLP(PlainMLP):
    def forward(self, x):
        return self.down(F.silu(self.gate(x)))


def test_a_model_that_is_one_ffn_is_named_root_everywhere(caplog):
    """No module path of its own: "root" in explain's rewrites and rejections, its table and log
    lines, layer_stats and prepare's report (never "" or a placeholder)."""
    x = torch.randn(3, K)
    twell_compile.reset_stats()
    with torch.no_grad(), caplog.at_level("INFO", logger="twell_compile"):
        rewritten = twell_compile.explain(mlp(), x, options=FORCE)
        left = twell_compile.explain(SiluMLP(K, N, bias=True), x)
        two = twell_compile.explain(lambda v, a=mlp(), b=mlp(): b(a(v)), x, options=FORCE)
    assert [r.layer for r in rewritten.rewrites] == ["root"] and [r.layer for r in left.rejections] == ["root"]
    assert [r.layer for r in two.rewrites] == ["root", "root#2"]     # a function holding two FFNs
    assert str(rewritten).splitlines()[-1].startswith("root ") and str(left).splitlines()[-1].startswith("root ")
    assert any(m.startswith("twell: rewrote root (") for m in caplog.messages)
    assert any(m.startswith("twell: left root to Inductor: ") for m in caplog.messages)
    assert set(twell_compile.layer_stats()) == {"root", "root#2"}
    assert [r.layer for r in twell_compile.prepare(mlp()).rewrites] == ["root"]
