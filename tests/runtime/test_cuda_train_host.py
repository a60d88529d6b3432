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
def test_backward_reads_its_path_from_the_saved_backup(monkeypatch, rows, hint, path):
    """A backup of M rows is the dense forward's g and u (used as saved, nothing recomputed);
    fewer rows is a compact hybrid state: densified when a dense forward saved it (a hint by
    address), else the sparse backward."""
    seen = {}

    def fake(name):
        def f(dy2, x2, wg, bg, wu, bu, wd, *rest):
            seen[name] = rest
            m, k = x2.shape
            return (torch.zeros(m, k), torch.zeros_like(wg), None, torch.zeros_like(wu), None, torch.zeros_like(wd))
        return f

    monkeypatch.setattr(cuda_train, "backward_sparse", fake("sparse"))
    monkeypatch.setattr(cuda_train, "backward_dense", fake("dense"))
    monkeypatch.setattr(cuda_train, "backward_densify", fake("densify"))
    m, k, n = 9, 8, 16
    x, dy = torch.randn(m, k).bfloat16(), torch.randn(m, k).bfloat16()
    wg, wu, wd = torch.randn(n, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(k, n).bfloat16()
    st = _saved(m, rows)
    if hint is not None:
        cuda_train._densify_hint(st[4], hint)
    cuda_train.ffn_train_backward(dy, x, wg, None, wu, None, wd, *st, 0.0)
    assert list(seen) == [path]
    if path != "dense":       # a controlled layer's coefficient reaches the kernels as a tensor
        seen.clear()
        if hint is not None:
            cuda_train._densify_hint(st[4], hint)
        coef = torch.ones(1)
        cuda_train.ffn_train_backward(dy, x, wg, None, wu, None, wd, *st, 0.5, l1_coef=coef)
        assert seen[path][-1] is coef and seen[path][-3] == 0.5 / (m * n)
        seen.clear()
        if hint is not None:
            cuda_train._densify_hint(st[4], hint)
        cuda_train.ffn_train_backward(dy, x, wg, None, wu, None, wd, *st, 0.0)
    if path == "dense":
        g, u, l1c, act, coef = seen["dense"]
        assert g is st[5] and u is st[6] and (l1c, act, coef) == (0.0, "relu", None)
    else:
        assert seen[path][-3:] == (0.0, "relu", None)     # no penalty: no coefficient tensor either
    seen.clear()
    if hint is not None:
        cuda_train._densify_hint(st[4], hint)        # (a hint is read once)
    cuda_train.ffn_train_backward(dy, x, wg, None, wu, None, wd, *st, 0.0, "drelu")
    assert seen[path][-2] == "drelu"          # the activation reaches the backward it took


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
        cuda_train._densify_hint(t, True)
    assert len(cuda_train._densify) == cuda_train.MAX_HINTS and keep[0].data_ptr() not in cuda_train._densify
    cuda_train.clear_hints()
    assert not cuda_train._densify
