"""Chooses the kernel for each op call by device, dtype and shape.

Today every device runs the exact plain-PyTorch implementations in ``kernels/torch_impl.py``;
device kernels register here as they land, each with the conditions under which it is exact
and faster. Decisions use only shapes, dtypes and devices: never tensor values (no host sync).
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from twell_compile.kernels import torch_impl


def _cuda_infer(x: Tensor):
    """The CUDA inference implementation (kernels/cuda_infer.py) for CUDA tensors, else None.

    Any CUDA dtype goes there: it runs TwELL kernels for bf16/fp16 where the shape rule and
    the layer's measured density allow (see kernels/cuda_policy.py), eager's dense calls
    otherwise. Without Triton it stays on torch_impl.
    """
    if not x.is_cuda:
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from twell_compile.kernels import cuda_infer

    return cuda_infer


def _cpu_infer(x: Tensor, w_gate: Tensor, w_down: Tensor):
    """The C++ CPU implementation (kernels/cpu_ffn.py) for fp32/bf16 CPU tensors, else None.

    Tiny FFNs (under ``cpu_ffn.MIN_WORK`` multiply-adds) stay on torch_impl: faster there.
    It decides sparse vs dense inside the kernel from the non-zeros it counts (docs/cpu.md).
    If the extension cannot be built it warns once and this returns None (torch_impl runs);
    ``cpu_ffn.active_impl()`` reports which one is active.
    """
    if x.device.type != "cpu":
        return None
    from twell_compile.kernels import cpu_ffn

    return cpu_ffn if cpu_ffn.supports(x, w_gate, w_down) else None


def ffn_infer(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
              b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
              tile_n: int, slots: int, layer: str, keep_stats: bool) -> Tensor:
    cuda = _cuda_infer(x)
    if cuda is not None:
        return cuda.ffn_infer(x, w_gate, b_gate, w_up, b_up, w_down, b_down, tile_n, slots, layer, keep_stats)
    cpu = _cpu_infer(x, w_gate, w_down)
    if cpu is not None:
        return cpu.ffn_infer(x, w_gate, b_gate, w_up, b_up, w_down, b_down, layer, keep_stats)
    return torch_impl.ffn_infer(x, w_gate, b_gate, w_up, b_up, w_down, b_down, layer, keep_stats)


def ffn_train_forward(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                      b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
                      ell_width: int, backup_rows: int, layer: str, keep_stats: bool) -> tuple[Tensor, ...]:
    return torch_impl.ffn_train_forward(x, w_gate, b_gate, w_up, b_up, w_down, b_down,
                                        ell_width, backup_rows, layer, keep_stats)


def ffn_train_backward(*args, **kwargs):
    return torch_impl.ffn_train_backward(*args, **kwargs)
