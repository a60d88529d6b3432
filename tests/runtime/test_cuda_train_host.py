"""Host-side rules of the CUDA training path (no GPU needed): which tensors it takes, and how a
backward finds the path its forward took."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from twell_compile.runtime import cuda_train, select  # noqa: E402


def test_cpu_and_fp32_stay_on_torch_impl():
    x = torch.randn(4, 8)
    assert not select.cuda_train_supported(x, 16, 8)
    assert not select.cuda_train_supported(x.bfloat16(), 16, 8)   # CPU bf16 too
    assert select.plan_train(x.bfloat16(), 16, 8, True, 4, 2, "t").path == "torch"


def _saved(m, rows, n=16, width=4):
    """A training op's saved state for m tokens with a backup of ``rows`` rows (CPU stand-ins)."""
    i32, bf = torch.int32, torch.bfloat16
    return (torch.zeros(m, dtype=i32), torch.zeros(m, width, dtype=i32), torch.zeros(m, width, dtype=bf),
            torch.zeros(m, width, dtype=bf), torch.arange(rows), torch.randn(rows, n).to(bf),
            torch.randn(rows, n).to(bf))


@pytest.mark.parametrize("rows, mark, path", [(3, None, "sparse"), (3, "densify", "densify"), (3, "sparse", "sparse"),
                                             (9, None, "dense"), (9, "densify", "dense"), (0, None, "sparse")])
def test_backward_reads_its_path_from_the_saved_state(rows, mark, path):
    """A backup of M rows is the dense forward's g and u (used as saved, nothing recomputed);
    fewer rows is a compact hybrid state: densified when a dense forward saved it, as the state
    carries (``mark_backward``, on its backup_idx), else the sparse backward. Reading it leaves
    the mark: a second backward of the same state takes the same path. (What each backward
    computes, with every activation and a coefficient tensor: tests/runtime/test_cuda_train.py
    on the GPU.)"""
    m = 9
    backup_idx = _saved(m, rows)[4]
    if mark is not None:
        cuda_train.mark_backward(backup_idx, mark)
    assert cuda_train.backward_path(backup_idx, m) == path
    assert cuda_train.backward_path(backup_idx, m) == path
    assert cuda_train.backward_path(backup_idx.clone(), m) == ("dense" if path == "dense" else "sparse")
    with pytest.raises(ValueError, match="backward must be one of"):
        cuda_train.mark_backward(backup_idx, "dense")


def test_backward_refuses_a_backup_larger_than_m():
    m, k, n = 4, 8, 16
    x = torch.randn(m, k).bfloat16()
    w = torch.randn(n, k).bfloat16()
    with pytest.raises(ValueError, match="backup_idx"):
        cuda_train.ffn_train_backward(x, x, w, None, w, None, w.t().contiguous(), *_saved(m, 5), 0.0)


def test_the_mark_reaches_the_backward_through_autograd_compile_and_checkpointing():
    """The mechanism ``mark_backward`` relies on, on an op registered as twell::ffn_train is (a
    custom op whose non-differentiable state outputs, one of unbacked rows, are saved for its
    backward op): an attribute set on a state tensor in the forward is on the tensor the
    backward op receives, eagerly, under torch.compile (Inductor, static and dynamic shapes)
    and under non-reentrant activation checkpointing (the recompute marks its own state)."""
    from torch.utils.checkpoint import checkpoint

    seen = []
    lib = "twell_test_mark"

    @torch.library.custom_op(f"{lib}::fwd", mutates_args=())
    def fwd(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        state = torch.arange(x.shape[0] // 2)
        cuda_train.mark_backward(state, "densify")
        return x @ w.t(), state, x[: state.shape[0]] * 2

    @fwd.register_fake
    def _(x, w):
        from torch._guards import detect_fake_mode
        from torch.fx.experimental.symbolic_shapes import guard_size_oblivious  # noqa: F401

        env = getattr(detect_fake_mode(), "shape_env", None)
        rows = env.create_unbacked_symint() if env is not None else x.shape[0] // 2
        if env is not None:
            torch._check(rows >= 0)
        return x.new_empty((x.shape[0], w.shape[0])), x.new_empty((rows,), dtype=torch.int64), \
            x.new_empty((rows, x.shape[1]))

    @torch.library.custom_op(f"{lib}::bwd", mutates_args=())
    def bwd(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, state: torch.Tensor,
            other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(cuda_train.backward_path(state, x.shape[0]))
        return dy @ w, dy.t() @ x

    @bwd.register_fake
    def _(dy, x, w, state, other):
        return torch.empty_like(x), torch.empty_like(w)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs, *output[1:])
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)

    def backward(ctx, dy, *_):
        return tuple(getattr(torch.ops, lib).bwd(dy, *ctx.saved_tensors))

    fwd.register_autograd(backward, setup_context=setup)

    def loss(x, w):
        return getattr(torch.ops, lib).fwd(torch.relu(x), w)[0].square().sum()

    x, w = torch.randn(8, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    runs = {"eager": loss, "checkpoint": lambda x, w: checkpoint(loss, x, w, use_reentrant=False)}
    for dynamic in (False, True):
        runs[f"compiled, dynamic={dynamic}"] = torch.compile(loss, backend="inductor", dynamic=dynamic)
    runs["compiled checkpoint"] = torch.compile(runs["checkpoint"], backend="inductor")
    for name, run in runs.items():
        seen.clear()
        torch._dynamo.reset()
        run(x, w).backward()
        assert seen == ["densify"], name
