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


@pytest.mark.parametrize("rows, hint, path", [(3, None, "sparse"), (3, True, "densify"), (3, False, "sparse"),
                                             (9, None, "dense"), (0, None, "sparse")])
def test_backward_reads_its_path_from_the_saved_backup(rows, hint, path):
    """A backup of M rows is the dense forward's g and u (used as saved, nothing recomputed);
    fewer rows is a compact hybrid state: densified when a dense forward saved it (a hint by
    address, read once), else the sparse backward. (What each backward computes, with every
    activation and a coefficient tensor: tests/runtime/test_cuda_train.py on the GPU.)"""
    m = 9
    backup_idx = _saved(m, rows)[4]
    if hint is not None:
        cuda_train.densify_hint(backup_idx, hint)
    assert cuda_train.backward_path(backup_idx, m) == path
    assert cuda_train.backward_path(backup_idx, m) == ("dense" if path == "dense" else "sparse")


def test_backward_refuses_a_backup_larger_than_m():
    m, k, n = 4, 8, 16
    x = torch.randn(m, k).bfloat16()
    w = torch.randn(n, k).bfloat16()
    with pytest.raises(ValueError, match="backup_idx"):
        cuda_train.ffn_train_backward(x, x, w, None, w, None, w.t().contiguous(), *_saved(m, 5), 0.0)


def test_densify_hint_table_is_bounded():
    cuda_train.clear_hints()
    keep = [torch.arange(i + 2) for i in range(cuda_train.MAX_HINTS + 2)]
    for t in keep:
        cuda_train.densify_hint(t, True)
    m = len(keep[-1]) + 1
    assert [cuda_train.backward_path(t, m) for t in (keep[0], keep[1], keep[2], keep[-1])] == [
        "sparse", "sparse", "densify", "densify"]       # the oldest two hints were dropped
    cuda_train.clear_hints()
    assert cuda_train.backward_path(keep[-2], m) == "sparse"
