"""Host-side rules of the CUDA training path (no GPU needed): which tensors it takes, and how a
backward finds the path its forward took."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from twell_compile import dispatch  # noqa: E402
from twell_compile.kernels import cuda_train  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh():
    cuda_train._modes.clear()
    cuda_train._last.clear()
    yield
    cuda_train._modes.clear()
    cuda_train._last.clear()


def test_cpu_and_fp32_stay_on_torch_impl():
    x = torch.randn(4, 8)
    wg, wd = torch.randn(16, 8), torch.randn(8, 16)
    assert not cuda_train.supports(x, wg, wd)
    assert dispatch._cuda_train(x, wg, wd) is None
    assert not cuda_train.supports(x.bfloat16(), wg.bfloat16(), wd.bfloat16())   # CPU bf16 too


def test_backward_takes_its_forwards_path():
    key = ("cpu", torch.bfloat16, 8, 16, 8, True)
    a, b = torch.zeros(5, dtype=torch.int32), torch.zeros(7, dtype=torch.int32)
    cuda_train._remember(a, key, True)
    cuda_train._remember(b, key, False)
    assert cuda_train._mode(a, key) is True       # by the saved counts tensor, not the last call
    assert cuda_train._mode(b, key) is False
    # looked up once: a second backward over the same tensor falls back to the last forward
    assert cuda_train._mode(a, key) is False


def test_mode_table_is_bounded(monkeypatch):
    monkeypatch.setattr(cuda_train, "_MAX_MODES", 3)
    key = ("cpu", torch.bfloat16, 8, 16, 8, True)
    keep = [torch.zeros(i + 1, dtype=torch.int32) for i in range(5)]
    for t in keep:
        cuda_train._remember(t, key, True)
    assert len(cuda_train._modes) == 3
    assert keep[0].data_ptr() not in cuda_train._modes
