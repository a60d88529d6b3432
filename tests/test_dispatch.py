"""Compile-time dispatch facts: when the inference op would surely run dense on CUDA."""

import torch

from twell_compile import dispatch
from twell_compile.kernels import cuda_policy

CUDA = torch.device("cuda")


def test_cpu_never_skipped():
    assert dispatch.static_dense_reason(torch.device("cpu"), torch.float32, 1, 16, 40, 16) is None


def test_cuda_fp32_is_dense():
    why = dispatch.static_dense_reason(CUDA, torch.float32, 65536, 2048, 5632, 2048)
    assert why and "float32" in why


def test_cuda_few_static_tokens_are_dense_but_dynamic_tokens_are_not():
    few = cuda_policy.MIN_TOKENS - 1
    assert "tokens" in dispatch.static_dense_reason(CUDA, torch.bfloat16, few, 2048, 5632, 2048)
    assert dispatch.static_dense_reason(CUDA, torch.bfloat16, cuda_policy.MIN_TOKENS, 2048, 5632, 2048) is None
    assert dispatch.static_dense_reason(CUDA, torch.bfloat16, None, 2048, 5632, 2048) is None


def test_cuda_too_wide_is_dense():
    assert "wide" in dispatch.static_dense_reason(CUDA, torch.float16, None, cuda_policy.MAX_WIDTH + 1, 64, 64)
    assert "wide" in dispatch.static_dense_reason(CUDA, torch.float16, None, 64, cuda_policy.MAX_N + 1, 64)
