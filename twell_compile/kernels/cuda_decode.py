"""Host side of the decode path (kernels/twell_decode.py): few tokens, bf16/fp16, three launches.

For x [M, K] with M <= MAX_M: gate GEMV + ReLU over all of W_gate, then the up projection for
the union of active neurons only (W_up rows, contiguous in nn.Linear's [N, K] layout), then the
down projection from W_down^T rows ([N, K_out], made once per weight by ``weight_cache``). No
host sync, fixed launch shapes per M: CUDA-graph capturable. Exact at any density: a neuron
is skipped only where relu(g) is 0 in every row (and no row of x holds NaN/Inf).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from twell_compile.kernels import weight_cache

MAX_M = 256           # M_P x BN fp32 gate tile in registers; the policy uses a smaller threshold


class Config(NamedTuple):
    bn: int        # neurons per gate program
    bk: int        # K step of the gate/up loops
    gate_warps: int
    gate_stages: int
    ch: int        # columns per down step
    ns: int        # columns per down split (partials: N / ns of [M, K_out] fp32)
    bko: int       # K_out columns per down program
    down_warps: int


# By padded M. Defaults before tuning on the device; see docs/inference.md "Decode".
CONFIGS = {
    16: Config(32, 256, 4, 4, 128, 256, 64, 4),
    32: Config(32, 256, 4, 3, 128, 512, 64, 4),
    64: Config(64, 128, 4, 3, 128, 1024, 64, 4),
    128: Config(32, 64, 8, 3, 128, 1024, 64, 8),
    256: Config(32, 64, 8, 2, 64, 1024, 64, 8),
}
FINISH_ELEMS = 8192   # partial elements per finishing program (S_P x BLOCK)


def _pow2(v: int) -> int:
    return 1 << max(0, (int(v) - 1).bit_length())


def m_pad(m: int) -> int:
    return max(16, _pow2(m))


class Decoded(NamedTuple):
    y: Tensor        # [M, K_out]
    tok: Tensor      # [M + 1] int32: non-zeros of relu(g) per token, then their total
    hsum: Tensor     # [1] fp32: sum |h|


def decode_forward(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                   b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
                   cfg: Optional[Config] = None) -> Decoded:
    """The FFN for x2 [M, K], M <= MAX_M, reading W_up / W_down rows of active neurons only."""
    from twell_compile.kernels.twell_decode import (decode_down_kernel, decode_finish_kernel,
                                                    decode_gate_kernel)

    m, k = x2.shape
    n, k_out = w_gate.shape[0], w_down.shape[0]
    if m > MAX_M:
        raise ValueError(f"decode path takes M <= {MAX_M} rows, got x with {m}")
    dev, dt = x2.device, x2.dtype
    y = torch.empty((m, k_out), dtype=dt, device=dev)
    if m == 0:
        return Decoded(y, torch.zeros(1, dtype=torch.int32, device=dev),
                       torch.zeros(1, dtype=torch.float32, device=dev))
    mp = m_pad(m)
    c = cfg or CONFIGS[mp]
    nb = -(-n // c.bn)
    s = -(-n // c.ns)
    s_p = _pow2(s)
    wdt = weight_cache.transposed(w_down)
    h = torch.empty((m, n), dtype=dt, device=dev)
    f32 = torch.empty(s * m * k_out + nb + 1, dtype=torch.float32, device=dev)
    part, hs, hsum = f32[: s * m * k_out], f32[s * m * k_out: -1], f32[-1:]
    i32 = torch.empty(nb * m + m + 1, dtype=torch.int32, device=dev)
    cnt, tok = i32[: nb * m], i32[nb * m:]
    wu = w_up if w_up is not None else w_gate
    decode_gate_kernel[(nb,)](
        x2, x2.stride(0), x2.stride(1),
        w_gate, w_gate.stride(0), w_gate.stride(1), b_gate if b_gate is not None else x2,
        wu, wu.stride(0), wu.stride(1), b_up if b_up is not None else x2,
        h, h.stride(0), cnt, hs, m, k, n,
        GATED=w_up is not None, HAS_BG=b_gate is not None, HAS_BU=b_up is not None,
        M_P=mp, BN=c.bn, BK=min(c.bk, max(16, _pow2(k))),
        num_warps=c.gate_warps, num_stages=c.gate_stages)
    bko = min(c.bko, max(16, _pow2(k_out)))
    decode_down_kernel[(-(-k_out // bko), s)](
        h, h.stride(0), wdt, wdt.stride(0), wdt.stride(1), part, m, n, k_out, c.ns,
        M_P=mp, CH=min(c.ch, c.ns), BKO=bko, num_warps=c.down_warps)
    block = max(16, min(1024, FINISH_ELEMS // s_p))
    nb_ch = max(1, min(_pow2(nb), FINISH_ELEMS // mp))
    decode_finish_kernel[(-(-(m * k_out) // block) + 1,)](
        part, b_down if b_down is not None else x2, y, y.stride(0), y.stride(1),
        cnt, hs, tok, hsum, m, k_out, s, nb,
        HAS_BD=b_down is not None, S_P=s_p, BLOCK=block, M_P=mp, NB_CH=nb_ch, num_warps=4)
    return Decoded(y, tok, hsum)
