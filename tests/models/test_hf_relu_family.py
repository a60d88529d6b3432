"""Squared ReLU and dReLU in Hugging Face models, tiny configs on the CPU: NVIDIA's Nemotron
(``hidden_act="relu2"``: ACT2FN's ReLUSquaredActivation, non-gated), a Llama with ``relu2``
(gated squared ReLU) and a Llama whose MLP is TurboSparse's dReLU (relu(gate) * relu(up)).
Each FFN is rewritten with its activation (explain, prepare, export), logits and every
gradient match eager (the 2x rule), and layer_stats names each FFN by its module path."""

from __future__ import annotations

import copy

import pytest
import torch

import twell_compile
from twell_compile.ops import arg_index

from tests.helpers import REWRITE_ALL
from tests.models.hf_tiny import LAYERS, check_inference_and_training, decoder, main_output, token_ids
from tests.passes.rewrite_harness import PassBackend, check_close

transformers = pytest.importorskip("transformers")


class DReLUMLP(transformers.models.llama.modeling_llama.LlamaMLP):
    """TurboSparse-Mistral's MLP: both factors rectified (its released code's forward)."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.act_fn(self.up_proj(x)))


def _model(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "nemotron-relu2":
        return transformers.NemotronForCausalLM(decoder("NemotronConfig")("relu2")).eval()
    model = transformers.LlamaForCausalLM(decoder("LlamaConfig", mlp_bias=True)("relu2" if kind == "llama-relu2"
                                                                                   else "relu")).eval()
    if kind == "llama-drelu":
        for layer in model.model.layers:
            layer.mlp.__class__ = DReLUMLP
    with torch.no_grad():      # HF zero-inits biases: random ones exercise the bias path
        for p in model.parameters():
            if p.dim() == 1 and not p.any():
                p.normal_(0, 0.1)
    return model


KINDS = {"nemotron-relu2": (False, "relu2"), "llama-relu2": (True, "relu2"), "llama-drelu": (True, "drelu")}
LAYER_NAMES = [f"model.layers.{i}.mlp" for i in range(LAYERS)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_layer_rewritten_with_its_activation(kind: str) -> None:
    gated, act = KINDS[kind]
    model = _model(kind)
    ids = token_ids()
    with torch.no_grad():
        report = twell_compile.explain(model, input_ids=ids, options=REWRITE_ALL)
    assert [(r.layer, r.gated, r.act, r.op) for r in report.rewrites] == [
        (name, gated, act, "twell::ffn") for name in LAYER_NAMES], str(report)
    assert not report.rejections and f"{'gated' if gated else 'non-gated'} {act}" in str(report), str(report)

    check_inference_and_training(model, ids)


@pytest.mark.parametrize("kind", list(KINDS))
def test_end_to_end_training_with_the_penalty(kind: str) -> None:
    """backend="twell" with Inductor, the L1 penalty on: logits and gradients as eager's with
    the penalty on the activation fed to the down projection (relu(g)^2 [* u], relu(g) relu(u))."""
    model = _model(kind, seed=1)
    ids = token_ids(2, (2, 9))
    l1 = 0.3
    twell_compile.reset_stats()
    torch._dynamo.reset()
    got = main_output(torch.compile(model, backend="twell", options={**REWRITE_ALL, "twell.l1": l1})(input_ids=ids))
    hidden: list[torch.Tensor] = []
    hooks = [layer.mlp.down_proj.register_forward_pre_hook(lambda _m, a: hidden.append(a[0]))
             for layer in model.model.layers]
    try:
        want = main_output(model(input_ids=ids))
    finally:
        for h in hooks:
            h.remove()
    check_close("logits", got, want)
    dy = torch.randn_like(want)
    params = [p for p in model.parameters()]
    penalty = l1 * torch.stack([h.abs().mean() for h in hidden]).mean()
    g_got = torch.autograd.grad(got, params, dy)
    g_want = torch.autograd.grad((want * dy).sum() + penalty, params)
    for (name, _), a, b in zip(model.named_parameters(), g_got, g_want, strict=True):
        check_close(f"grad {name}", a, b)
    stats = twell_compile.layer_stats()
    assert sorted(stats) == LAYER_NAMES and all(s.tokens == 18 for s in stats.values())
    h0 = hidden[0].detach()
    assert abs(stats[LAYER_NAMES[0]].l1 - h0.abs().mean().item()) <= 1e-5 * max(1.0, h0.abs().mean().item())


@pytest.mark.parametrize("kind", list(KINDS))
def test_prepare_and_export(kind: str) -> None:
    gated, act = KINDS[kind]
    model = _model(kind)
    ids = token_ids(3)
    with torch.no_grad():
        want = main_output(model(input_ids=ids))
    prepared = copy.deepcopy(model)
    report = twell_compile.prepare(prepared, options={"twell.skip_dense": False})
    assert [(r.layer, r.act) for r in report.rewrites] == [(name, act) for name in LAYER_NAMES], str(report)
    with torch.no_grad():
        check_close("prepared logits", main_output(prepared(input_ids=ids)), want)
    program, report = twell_compile.export(model, (), {"input_ids": ids, "use_cache": False}, options=REWRITE_ALL)
    assert [r.act for r in report.rewrites] == [act] * LAYERS, str(report)
    ops = [n for n in program.graph.nodes if n.op == "call_function" and str(n.target) == "twell.ffn.default"]
    pos = arg_index(torch.ops.twell.ffn.default, "act")
    assert len(ops) == LAYERS and all((n.args[pos] if len(n.args) > pos else n.kwargs.get("act")) == act for n in ops)
    with torch.no_grad():
        check_close("exported logits", main_output(program.module()(input_ids=ids, use_cache=False)), want)


def test_nemotron_near_miss_activations_stay_exact() -> None:
    """Nemotron with relu (plain ReLU) is rewritten as ReLU; with gelu it is left alone."""
    torch.manual_seed(0)
    model = transformers.NemotronForCausalLM(decoder("NemotronConfig")("gelu")).eval()
    ids = token_ids(4)
    with torch.no_grad():
        report = twell_compile.explain(model, input_ids=ids, options=REWRITE_ALL)
        assert not report.rewrites and len(report.rejections) == LAYERS, str(report)
        backend = PassBackend()
        got = main_output(torch.compile(model, backend=backend)(input_ids=ids))
        assert not backend.twell_ops() and torch.equal(got, main_output(model(input_ids=ids)))
