"""torch.export with the rewrite, and an AOTInductor package run in a fresh process."""

import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import twell_compile
from twell_compile.testing import Block, GatedMLP, PlainMLP

# These FFNs are tiny: force the rewrite whatever a device's skip_dense rule would leave to Inductor.
REWRITE = {"twell.skip_dense": False}


def two_ffns() -> nn.Sequential:
    """A gated FFN, then a plain one, each added to its input (biases, no norm)."""
    return nn.Sequential(Block(GatedMLP(16, 40, bias=True), norm=False), Block(PlainMLP(16, 24, bias=True), norm=False))


def test_export_rewrites_and_matches_eager():
    torch.manual_seed(0)
    m = two_ffns().eval()
    x = torch.randn(3, 5, 16)
    ep, report = twell_compile.export(m, (x,), options=REWRITE)
    assert len(report.rewrites) == 2 and {r.gated for r in report.rewrites} == {True, False}
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.twell.ffn.default) == 2
    assert torch.ops.aten.relu.default not in targets
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), m(x), atol=1e-5, rtol=1e-5)


def test_static_export_reports_the_program_sizes():
    # Dynamo used to trace symbolically: the report read [s0, s1] for a program fixed at [3, 5].
    ep, report = twell_compile.export(two_ffns().eval(), (torch.randn(3, 5, 16),), options=REWRITE)
    assert [r.tokens_shape for r in report.rewrites] == ["[3, 5]", "[3, 5]"]
    assert not ep.range_constraints  # no symbolic size left in the program
    assert "[3, 5]" in str(report)


def test_program_runs_with_grad_enabled_and_leaves_the_model_alone():
    torch.manual_seed(2)
    m = two_ffns().eval()
    x = torch.randn(4, 16)
    ep, _ = twell_compile.export(m, (x,), options=REWRITE)
    prog = ep.module()
    assert torch.is_grad_enabled()
    y = prog(x)
    torch.testing.assert_close(y, m(x), atol=1e-5, rtol=1e-5)  # no no_grad needed
    assert not y.requires_grad                            # the program reads its weights detached
    assert all(p.requires_grad for p in m.parameters())  # the model still trains
    # The program shares the model's storage: an in-place update is seen by the next call.
    with torch.no_grad():
        m[1].mlp.gate.weight.mul_(2)
    torch.testing.assert_close(prog(x), m(x), atol=1e-5, rtol=1e-5)
    # An input that requires grad cannot get one through the inference op: the error names the fix.
    with pytest.raises(ValueError, match="no_grad"):
        prog(x.clone().requires_grad_())


CHANGES = {
    "in place": lambda w: w.mul_(2),
    ".data =": lambda w: setattr(w, "data", torch.randn_like(w)),
    "set_": lambda w: w.set_(torch.randn_like(w)),
    "load_state_dict": None,       # (the whole model's, below)
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_program_sees_every_weight_change_the_model_sees(change):
    """``ep.module()`` used the old weights after ``w.data = t`` or ``w.set_(t)`` (max abs diff
    18.8), where plain torch.export's program sees them: the program now holds the model's own
    parameters and reads them detached, so every change is seen by its next call."""
    torch.manual_seed(4)
    m = two_ffns().eval()
    x = torch.randn(4, 16)
    ep, _ = twell_compile.export(m, (x,), options=REWRITE)
    prog = ep.module()
    with torch.no_grad():
        if CHANGES[change] is None:
            m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()})
        else:
            for w in (m[0].mlp.up.weight, m[0].mlp.down.weight, m[1].mlp.gate.bias):
                CHANGES[change](w)
    with torch.no_grad():
        torch.testing.assert_close(prog(x), m(x), atol=1e-5, rtol=1e-5)
    assert not prog(x).requires_grad


def test_dynamic_batch_exports_one_program_for_every_batch():
    torch.manual_seed(3)
    m = two_ffns().eval()
    ep, report = twell_compile.export(m, (torch.randn(3, 5, 16),), dynamic_batch=True, options=REWRITE)
    assert [r.tokens_shape for r in report.rewrites] == ["[batch, 5]", "[batch, 5]"]
    assert len(ep.range_constraints) == 1
    for b in (1, 2, 7):
        x = torch.randn(b, 5, 16)
        torch.testing.assert_close(ep.module()(x), m(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(Exception):   # the sequence length stayed static
        ep.module()(torch.randn(2, 6, 16))
    with pytest.raises(ValueError, match="batch of at least 2"):
        twell_compile.export(m, (torch.randn(1, 5, 16),), dynamic_batch=True)
    with pytest.raises(ValueError, match="either dynamic_shapes or dynamic_batch"):
        twell_compile.export(m, (torch.randn(3, 5, 16),), dynamic_batch=True, dynamic_shapes={"x": {0: 3}})


def test_dynamic_shapes_pass_through_and_name_the_report_sizes():
    torch.manual_seed(4)
    m = two_ffns().eval()
    b, s = torch.export.Dim("b"), torch.export.Dim("seq")
    # (by the argument's name: nn.Sequential's is "input")
    ep, report = twell_compile.export(m, (torch.randn(3, 5, 16),), dynamic_shapes={"input": {0: b, 1: s}},
                                       options=REWRITE)
    assert [r.tokens_shape for r in report.rewrites] == ["[b, seq]", "[b, seq]"]
    x = torch.randn(2, 9, 16)
    torch.testing.assert_close(ep.module()(x), m(x), atol=1e-5, rtol=1e-5)


def test_hf_model_with_cache_gets_the_use_cache_fix():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=88, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, hidden_act="relu",
                                   max_position_embeddings=64)
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(cfg).eval()
    assert model.config.use_cache
    ids = torch.randint(1, 128, (2, 7))
    with pytest.raises(ValueError, match=r"DynamicCache.*use_cache': False"):
        twell_compile.export(model, (ids,))
    ep, report = twell_compile.export(model, (ids,), {"use_cache": False}, options=REWRITE)
    assert [r.tokens_shape for r in report.rewrites] == ["[2, 7]", "[2, 7]"]
    torch.testing.assert_close(ep.module()(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True])
def test_grouped_moe_experts_export(dynamic):
    """A tiny Mixtral (transformers' batched experts, experts_implementation="grouped_mm"): the
    program runs one twell::experts per MoE block in place of the grouped GEMMs (the routing
    stays stock), its logits on other tokens (another routing) match eager, and a dynamic
    batch shows in the report as the routed rows' expression in the Dim's name."""
    pytest.importorskip("transformers")
    from tests.models.hf_tiny import LAYERS, moe_model, token_ids

    model = moe_model("mixtral")
    kw = {"dynamic_batch": True} if dynamic else {}
    ep, report = twell_compile.export(model, (token_ids(shape=(2, 7)),), {"use_cache": False}, options=REWRITE, **kw)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.twell.experts.default) == LAYERS
    assert torch.ops.aten._grouped_mm.default not in targets
    assert [r.tokens_shape for r in report.rewrites] == ["[14*batch]" if dynamic else "[28]"] * LAYERS
    ids = token_ids(seed=3, shape=(3 if dynamic else 2, 7))
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                   atol=1e-5, rtol=1e-5)


def test_module_list_experts_export():
    """The per-expert nn.ModuleList MoE block: each expert's FFN on its routed rows (a
    data-dependent count) is one twell::ffn in the program; other inputs route differently and
    still match eager."""
    pytest.importorskip("transformers")
    from tests.models.test_hf_moe import EXPERTS, ListNet

    torch.manual_seed(4)
    net = ListNet().eval()
    ep, report = twell_compile.export(net, (torch.randn(2, 7, 16),), options=REWRITE)
    assert [r.layer for r in report.rewrites] == [f"moe.experts.{i}" for i in range(EXPERTS)]
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.twell.ffn.default) == EXPERTS
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), net(x), atol=1e-5, rtol=1e-5)


def test_export_argument_errors():
    with pytest.raises(TypeError, match="model must be"):
        twell_compile.export(lambda x: x, (torch.randn(2),))
    with pytest.raises(TypeError, match="args must be a tuple"):
        twell_compile.export(two_ffns(), torch.randn(2, 16))
    with pytest.raises(ValueError, match="only twell"):
        twell_compile.export(two_ffns(), (torch.randn(2, 16),), options={"max_autotune": True})


@pytest.mark.skipif(torch.__version__ < (2, 13),
                    reason="AOTInductor on torch 2.11 segfaults calling Python custom ops (seen on the H200 machine)")
def test_aoti_package_runs_in_fresh_process(tmp_path):
    torch.manual_seed(1)
    m = two_ffns().eval()
    x = torch.randn(4, 16)
    ep, _ = twell_compile.export(m, (x,), options=REWRITE)
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "ffn.pt2"))
    torch.save({"x": x, "y": m(x).detach()}, tmp_path / "io.pt")
    run = ("import torch{imp}\n"
           f"d = torch.load({str(tmp_path / 'io.pt')!r})\n"
           f"r = torch._inductor.aoti_load_package({pkg!r})\n"
           "torch.testing.assert_close(r(d['x']), d['y'], atol=1e-5, rtol=1e-5)\n"
           "print('ok')\n")
    ok = subprocess.run([sys.executable, "-c", run.format(imp=", twell_compile.ops")],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and ok.stdout.strip().endswith("ok"), ok.stderr[-3000:]
    # Without registering the ops the documented error names what is missing.
    bad = subprocess.run([sys.executable, "-c", run.format(imp="")], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "twell::ffn" in bad.stderr
