"""Hugging Face model families, tiny configs on the CPU: ReLU FFNs are rewritten (one per layer),
SiLU/GELU ones are left alone with a reason, and logits and gradients match eager.

Most checks run the rewritten graph eagerly (PassBackend: the rewrite and our autograd formula,
without Inductor's compile time); every family also goes end to end through backend="twell".
The other families' end-to-end tests are marked ``slow``; they run by default (CI included),
and ``-m "not slow"`` leaves them out for a quick local run.
"""

from __future__ import annotations

import pytest
import torch

import twell_compile

from tests.helpers import REWRITE_ALL
from tests.models.hf_tiny import (FAMILIES, LAYERS, build, check_inference_and_training, compare_grads,
                                  main_output, token_ids)
from tests.passes.rewrite_harness import PassBackend, check_close

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_relu_family_rewrites_every_layer(name: str) -> None:
    fam = FAMILIES[name]
    model = build(name, "relu")
    ids = token_ids()
    with torch.no_grad():
        report = twell_compile.explain(model, input_ids=ids, options=REWRITE_ALL)
    assert len(report.rewrites) == LAYERS and not report.rejections, str(report)
    assert all(r.op == "twell::ffn" and r.gated == fam.gated for r in report.rewrites), str(report)
    assert report.rewrites[0].layer == fam.layer, str(report)

    # Inference, then training (the training op with our backward): logits and every gradient.
    check_inference_and_training(model, ids)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_layer_names_are_module_paths(name: str) -> None:
    """explain and layer_stats name each FFN by its module path, whatever source prefix Dynamo
    gives the compiled callable (transformers 5.24 wraps forward: ``L['args'][0].model...``)."""
    fam = FAMILIES[name]
    model = build(name, "relu")
    want = [fam.layer.replace(".0", f".{i}", 1) for i in range(LAYERS)]
    modules = dict(model.named_modules())
    assert all(w in modules for w in want), want
    with torch.no_grad():
        report = twell_compile.explain(model, input_ids=token_ids(), options=REWRITE_ALL)
    assert [r.layer for r in report.rewrites] == want, str(report)
    # Training graphs and the per-layer statistics use the same names.
    report = twell_compile.explain(model, input_ids=token_ids(), options=REWRITE_ALL)
    assert [r.layer for r in report.rewrites] == want, str(report)
    torch._dynamo.reset()
    twell_compile.reset_stats()
    compiled = torch.compile(model, backend="twell", options={"twell.l1": 1e-3})
    main_output(compiled(input_ids=token_ids())).sum().backward()
    assert set(twell_compile.layer_stats()) >= set(want), twell_compile.layer_stats()


def test_tiny_models_stay_with_inductor_on_a_cpu_with_the_reason() -> None:
    """A tiny ReLU Llama on the CPU: under the C++ kernel's width and token count plain PyTorch would run
    (0.57x of Inductor's forward measured on the 2-core CPU, 2026-11-25), so both FFNs are left
    to Inductor, each with the reason; training without a penalty likewise."""
    model = build("llama", "relu")
    with torch.no_grad():
        report = twell_compile.explain(model, input_ids=token_ids())
    assert not report.rewrites and len(report.rejections) == LAYERS, str(report)
    assert all("CPU kernel" in r.reason and "Inductor" in r.reason for r in report.rejections), str(report)
    report = twell_compile.explain(model, input_ids=token_ids())
    assert not report.rewrites and all("training on CPU" in r.reason for r in report.rejections), str(report)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_default_activation_is_rejected_and_exact(name: str) -> None:
    fam = FAMILIES[name]
    model = build(name, fam.default_act)
    ids = token_ids(1)
    with torch.no_grad():
        report = twell_compile.explain(model, input_ids=ids)
    assert not report.rewrites, str(report)
    assert len(report.rejections) == LAYERS, str(report)
    assert all(fam.default_reason in r.reason and "not ReLU" in r.reason for r in report.rejections), str(report)
    backend = PassBackend()
    with torch.no_grad():
        got = main_output(torch.compile(model, backend=backend)(input_ids=ids))
        want = main_output(model(input_ids=ids))
    assert not backend.twell_ops()
    assert torch.equal(got, want)


def _end_to_end(name: str, grad: bool) -> None:
    model = build(name, "relu", seed=1)
    ids = token_ids(2, (2, 9))
    with torch.set_grad_enabled(grad):
        got = main_output(torch.compile(model, backend="twell", options=REWRITE_ALL)(input_ids=ids))
        want = main_output(model(input_ids=ids))
    check_close("logits", got, want)
    if grad:
        compare_grads(model, got, want)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_llama_end_to_end(grad: bool) -> None:
    _end_to_end("llama", grad)


def test_opt_end_to_end_training() -> None:
    _end_to_end("opt", True)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in ("llama", "opt")])
def test_family_end_to_end_training(name: str) -> None:
    _end_to_end(name, True)
