"""The fused gate GEMM: twell::gate_pack (csrc/gate_pack*.cu, CUTLASS sm90 kernels packing TwELL
in their epilogue), built on first use. cuda_infer.merge_rows makes the per-row lists from its
packed tiles.

``CONFIGS`` names each kernel configuration by its index, as the record's ``gate_cfg`` does. A
call that cannot run it (not sm90, not bf16, K or N not a multiple of 8, N > 65536, no CUDA
compiler or no CUTLASS headers to build it) goes to cuBLAS and the compaction pass instead: the
reason comes from ``unusable`` and, for a failed build, one warning per process that says how to
get the fused kernels.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from twell_compile.build import BuildError, load

log = logging.getLogger(__name__)


class GateConfig(NamedTuple):
    tile_n: int        # columns per TwELL tile (the CTA tile's N)
    what: str


# index = the record's gate_cfg, = the C++ dispatch's cfg (csrc/gate_pack.cu kTileN, checked by a test)
CONFIGS = (
    GateConfig(256, "128x256x64 CTA tile, 2x1 cluster, cooperative"),
    GateConfig(256, "128x256x64 CTA tile, 1x2 cluster, cooperative"),
    GateConfig(128, "256x128x64 CTA tile, 1x2 cluster, cooperative"),
    GateConfig(256, "64x256x64 tile per warpgroup, 2x1 cluster, ping-pong"),
    GateConfig(128, "128x128x64 tile per warpgroup, 2x1 cluster, ping-pong"),
    GateConfig(128, "128x128x64 tile per warpgroup, 1x2 cluster, ping-pong"),
)
# What gate_pack writes of g: all of it; only the row tiles that merge_rows cannot rebuild from
# the slots (over their slots, or holding a non-finite value); none (the packing alone).
G_MODES = ("all", "spills", "none")

_build_error: list[str] = []
_said: set[str] = set()     # reasons already logged (once each per process)


def module():
    """The built extension (twell_gate_pack); raises BuildError once built failed in this process."""
    if _build_error:
        raise BuildError(_build_error[0])
    try:
        return load("gate_pack")
    except BuildError as e:
        _build_error.append(str(e))
        log.warning("twell: the fused gate GEMM (CUTLASS) could not be built, so the per-row path uses cuBLAS "
                    "and a compaction pass: %s. To get it: the CUDA toolkit's nvcc (or `pip install "
                    "nvidia-cuda-nvcc`) and `pip install nvidia-cutlass`.", e)
        raise


@functools.lru_cache(maxsize=None)
def _device_reason(index: int) -> Optional[str]:
    major, minor = torch.cuda.get_device_capability(index)
    return None if (major, minor) == (9, 0) else f"compute capability {major}.{minor}, not 9.0 (sm90a kernels)"


def unusable(x2: Tensor, w: Tensor, b: Optional[Tensor]) -> Optional[str]:
    """Why twell::gate_pack cannot compute relu(x2 w^T + b) here, or None when it can."""
    if x2.device.type != "cuda":
        return "not a CUDA tensor"
    if x2.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or (b is not None and b.dtype != torch.bfloat16):
        return "the fused gate GEMM is built for bfloat16"
    n, k = w.shape
    if not (w.is_contiguous() and x2.is_contiguous()):
        return "x and w_gate must be contiguous"
    if k % 8 or n % 8:
        return f"K={k} and N={n} must be multiples of 8 (16-byte TMA rows)"
    if n > 65536:
        return f"N={n} > 65536: packed columns take 16 bits"
    reason = _device_reason(x2.device.index if x2.device.index is not None else torch.cuda.current_device())
    if reason is not None:
        return reason
    if _build_error:
        return f"not built: {_build_error[0]}"
    return None


def reset_log() -> None:
    """Forget which reasons ``runs`` has logged, so each is logged again once."""
    _said.clear()


def runs(x2: Tensor, w: Tensor, b: Optional[Tensor]) -> bool:
    """Whether twell::gate_pack runs this call: ``unusable`` says None and the extension is built
    (built here on first use; a failed build warns once and answers False from then on). Where
    it does not run, the reason is logged at INFO, once per reason."""
    reason = unusable(x2, w, b)
    if reason is not None:
        if reason not in _said:
            _said.add(reason)
            log.info("twell: the record names the fused gate GEMM, but this call runs cuBLAS and the "
                     "compaction pass: %s", reason)
        return False
    try:
        module()
    except BuildError:
        return False
    return True


def tiles(n: int, cfg: int) -> int:
    return -(-n // CONFIGS[cfg].tile_n)


def gate_pack(x2: Tensor, w: Tensor, b: Optional[Tensor], cfg: int, slots: int, raster: int = 0,
              swizzle: int = 1, g: str = "all") -> tuple[Tensor, Tensor, Tensor]:
    """(g [M, N] or an empty tensor for g="none", packed [M, T, slots] int32, tcnt [M, T] int32)
    by one launch of configuration ``cfg``. x2 [M, K] and w [N, K] contiguous bf16 (``unusable``
    says None). ``slots`` 0: no packing, g alone (empty packed and tcnt; the parts timed apart
    by tune_gate.py). ``g``: "all" writes g whole; "spills" only the row tiles with more
    non-zeros than slots or a non-finite value (the rest of g is left unwritten: the per-row
    path's merge_rows(..., tile_n=) rebuilds the rows that need it from the slots), which
    saves the epilogue g's store (M x N x 2 bytes); "none" writes no g."""
    if g not in G_MODES:
        raise ValueError(f"g must be one of {G_MODES}, got {g!r}")
    if g == "spills" and not slots:
        raise ValueError("g='spills' writes g where the packing spills: it needs slots > 0")
    module()
    m, n = x2.shape[0], w.shape[0]
    t = tiles(n, cfg) if slots else 0
    out = torch.empty((m, n) if g != "none" else (0,), dtype=x2.dtype, device=x2.device)
    packed = torch.empty((m, t, slots) if slots else (0, 0, 0), dtype=torch.int32, device=x2.device)
    tcnt = torch.empty((m, t) if slots else (0, 0), dtype=torch.int32, device=x2.device)
    torch.ops.twell.gate_pack(x2, w, b, out, packed, tcnt, cfg, raster, swizzle, g == "spills")
    return out, packed, tcnt
