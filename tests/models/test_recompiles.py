"""Dynamic shapes with the twell backend: after the first dynamic recompile, new batch sizes
(and sequence lengths) compile nothing new, in inference and in training; mark_dynamic makes
the first compile dynamic. Compiles are counted with a wrapper around the twell backend."""

from __future__ import annotations

import pytest
import torch

from twell_compile.backend import twell_backend

from tests.helpers import REWRITE_ALL
from tests.models.hf_tiny import VOCAB, build, main_output
from tests.passes.rewrite_harness import TWELL_OPS, check_close
from twell_compile.testing import Block, FusedMLP


class CountingTwell:
    def __init__(self):
        self.calls = 0
        self.ops: list[str] = []

    def __call__(self, gm, example_inputs, **kwargs):
        self.calls += 1
        compiled = twell_backend(gm, example_inputs, **kwargs)
        self.ops += [TWELL_OPS[str(n.target)] for n in gm.graph.nodes
                     if n.op == "call_function" and str(n.target) in TWELL_OPS]
        return compiled


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_no_recompile_after_first_dynamic_recompile(grad: bool) -> None:
    torch.manual_seed(0)
    model = Block(FusedMLP())
    backend = CountingTwell()
    compiled = torch.compile(model, backend=backend, options=REWRITE_ALL)
    # Batch sizes cross the training op's backup-capacity steps (ceil(M / 16)): 6, 12, 51 tokens.
    for step, batch in enumerate((2, 4, 3, 17, 9)):
        x = torch.randn(batch, 3, 16, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            got = compiled(x)
            want = model(x)
        check_close("output", got, want)
        if grad:
            dy = torch.randn_like(want)
            params = [x] + list(model.parameters())
            for a, b in zip(torch.autograd.grad(got, params, dy), torch.autograd.grad(want, params, dy)):
                check_close("grad", a, b)
        # First call static, second call recompiles with a dynamic batch, then no more.
        assert backend.calls == min(step + 1, 2), f"batch {batch}: {backend.calls} compiles"
    op = "twell::ffn_train" if grad else "twell::ffn"
    assert backend.ops == [op, op]


def test_mark_dynamic_compiles_once() -> None:
    torch.manual_seed(0)
    model = Block(FusedMLP())
    backend = CountingTwell()
    compiled = torch.compile(model, backend=backend, options=REWRITE_ALL)
    for batch in (4, 7, 2, 33):
        x = torch.randn(batch, 5, 16)
        torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            check_close("output", compiled(x), model(x))
    assert backend.calls == 1 and backend.ops == ["twell::ffn"]


def test_llama_mark_dynamic_batch_and_sequence() -> None:
    pytest.importorskip("transformers")
    model = build("llama", "relu", seed=2)
    backend = CountingTwell()
    compiled = torch.compile(model, backend=backend, options=REWRITE_ALL)
    gen = torch.Generator().manual_seed(3)
    for shape in ((2, 7), (3, 5), (5, 11)):
        ids = torch.randint(3, VOCAB, shape, generator=gen)
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(ids, 1)
        with torch.no_grad():
            check_close("logits", main_output(compiled(input_ids=ids)), main_output(model(input_ids=ids)))
    assert backend.calls == 1, f"{backend.calls} compiles"
    assert backend.ops == ["twell::ffn", "twell::ffn"]


@pytest.fixture
def cuda_count_rules():
    """The CUDA token-count rules answer these CPU compiles (as for bf16 CUDA tensors,
    select.compile_rules_for: CI has no GPU) at small thresholds: decode-sized <= 8, per-row
    sized and training >= 40, per-row K >= 16."""
    from twell_compile.runtime import arch, select

    with select.compile_rules_for("cuda", torch.bfloat16), arch.patched(
            decode_max_m=8, min_tokens=40, min_width=16, train_min_tokens=40, train_min_width=16):
        yield


def test_training_token_counts_across_the_small_m_rule(cuda_count_rules) -> None:
    """Under dynamic shapes a training FFN's token count is answered by the CUDA small-M rule
    under a guard (cuda_count_rules: MIN_TOKENS 40): the graph
    compiled at a small count leaves the FFN to Inductor and serves every count under 40; the
    first count over it recompiles once, rewritten; after that nothing compiles."""
    torch.manual_seed(0)
    model = Block(FusedMLP())
    backend = CountingTwell()
    compiled = torch.compile(model, backend=backend)
    # tokens: 6 (static), 12 (dynamic, < 40), 9, 51 (>= 40: recompiles), 27, 60, 15
    for step, (batch, calls) in enumerate(((2, 1), (4, 2), (3, 2), (17, 3), (9, 3), (20, 3), (5, 3))):
        x = torch.randn(batch, 3, 16, requires_grad=True)
        got = compiled(x)
        want = model(x)
        check_close("output", got, want)
        dy = torch.randn_like(want)
        params = [x] + list(model.parameters())
        for a, b in zip(torch.autograd.grad(got, params, dy), torch.autograd.grad(want, params, dy)):
            check_close("grad", a, b)
        assert backend.calls == calls, f"step {step}, {batch * 3} tokens: {backend.calls} compiles"
    assert backend.ops == ["twell::ffn_train"]      # only the graph guarded to >= 40 tokens


def test_training_mark_dynamic_across_the_small_m_rule(cuda_count_rules) -> None:
    """mark_dynamic's dimension may be narrowed to a range (not specialised): no
    ConstraintViolationError, one compile per side of the rule."""
    torch.manual_seed(0)
    model = Block(FusedMLP())
    backend = CountingTwell()
    compiled = torch.compile(model, backend=backend)
    for batch in (4, 7, 30, 2, 33):
        x = torch.randn(batch, 5, 16, requires_grad=True)
        torch._dynamo.mark_dynamic(x, 0)
        check_close("output", compiled(x), model(x))
    assert backend.calls == 2 and backend.ops == ["twell::ffn_train"]


@pytest.mark.parametrize("cudagraphs", ["off", "on"])
def test_inference_token_counts_across_the_ranges(cuda_count_rules, cudagraphs: str) -> None:
    """Inference under dynamic shapes (cuda_count_rules): each range compiles once; the band
    runs Inductor's FFN, per-row sized counts our op, decode-sized counts our op only where CUDA
    graphs replay the step."""
    torch.manual_seed(0)
    model = Block(FusedMLP())
    backend = CountingTwell()
    compiled = torch.compile(model, backend=backend, options={"twell.cudagraphs": cudagraphs})
    # tokens: 12 static (band), 15 dynamic (band), 27, 51 (per-row sized), 6 (decode-sized), 60,
    # 30, 9 (band again)
    expected = ((4, 1), (5, 2), (9, 2), (17, 3), (2, 4), (20, 4), (10, 4), (3, 4))
    for step, (batch, calls) in enumerate(expected):
        x = torch.randn(batch, 3, 16)
        with torch.no_grad():
            check_close("output", compiled(x), model(x))
        assert backend.calls == calls, f"step {step}, {batch * 3} tokens: {backend.calls} compiles"
    assert backend.ops == ["twell::ffn"] * (2 if cudagraphs == "on" else 1)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("max_tokens,rewritten", [(1000, True), (30, False)])
def test_a_users_dynamic_range_is_never_narrowed(cuda_count_rules, grad: bool, max_tokens: int,
                                                 rewritten: bool) -> None:
    """mark_dynamic(min=, max=) is a strict range: a guard narrowing it would fail the compile
    (ConstraintViolationError). A range spanning the rules' thresholds (cuda_count_rules) keeps
    the rewrite, unguarded (the op decides per
    call); a range wholly inside one side is answered without a guard."""
    torch.manual_seed(0)
    model = Block(FusedMLP())
    backend = CountingTwell()
    compiled = torch.compile(model, backend=backend)
    for batch in (12, 29, 13) if max_tokens < 40 else (12, 100, 9):
        x = torch.randn(batch, 16, requires_grad=grad)
        torch._dynamo.mark_dynamic(x, 0, min=9, max=max_tokens)
        with torch.set_grad_enabled(grad):
            check_close("output", compiled(x), model(x))
    assert backend.calls == 1
    assert backend.ops == ([("twell::ffn_train" if grad else "twell::ffn")] if rewritten else [])
