"""Hugging Face gradient checkpointing puts each decoder layer in a checkpoint subgraph: the
FFN is rewritten there, and gradients match eager."""

from __future__ import annotations

import pytest
import torch

from tests.models.hf_tiny import LAYERS, VOCAB, build
from tests.passes.rewrite_harness import PassBackend, check_close

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["llama", "opt"])
def test_gradient_checkpointing_rewrites_inside_subgraphs(name: str) -> None:
    model = build(name, "relu", seed=4)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    ex = torch._dynamo.explain(model)(input_ids=ids, labels=ids, use_cache=False)
    if ex.graph_break_count:  # e.g. OPT's LayerDrop in transformers 5.17 branches on torch.rand([])
        reason = ex.break_reasons[0].reason if ex.break_reasons else "frames skipped"
        pytest.skip(f"Dynamo graph-breaks this model, leaving layers eager for any backend: {reason}")
    torch._dynamo.reset()
    backend = PassBackend()
    got = torch.compile(model, backend=backend)(input_ids=ids, labels=ids, use_cache=False)
    want = model(input_ids=ids, labels=ids, use_cache=False)
    assert backend.twell_ops() == ["twell::ffn_train"] * LAYERS, str(backend.report)
    # Every rewrite happened in a subgraph (the checkpointed layer body), not the top graph.
    assert all(r.graph for r in backend.report.rewrites), str(backend.report)
    check_close("loss", got.loss, want.loss)
    params = list(model.parameters())
    for (name_, _), a, b in zip(model.named_parameters(), torch.autograd.grad(got.loss, params),
                                torch.autograd.grad(want.loss, params), strict=True):
        check_close(f"grad {name_}", a, b)
