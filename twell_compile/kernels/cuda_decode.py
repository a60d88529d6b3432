"""Host side of the decode path (kernels/twell_decode.py): few tokens, bf16/fp16.

For x [M, K] with M <= MAX_M: one zero-fill of the counters, then ``decode_gate_up_kernel``
(all of W_gate; W_up rows of active neurons only, contiguous in nn.Linear's [N, K] layout),
which appends (neuron, h) pairs to a list per row block, then ``decode_down_kernel`` over the
lists (W_down^T rows, [N, K_out], made once per weight by ``weight_cache``), plus a summing
kernel when the down kernel is split. No host sync, fixed launch shapes per M: CUDA-graph
capturable. Exact at any density: a neuron is skipped only where relu(g) is 0 and g finite
in every row of its row block.

H200, K=2048, N=5632, M=1, d=0.005 (benchmarks/results/h200/decode_run3/): 22.2 us vs dense
34.0 us; parts: zero-fill 2.1, gate GEMV 12.1 (cuBLAS alone 11.3), up for active neurons 5.3,
down 4.2 (M=16: 14.6 with one split). Earlier designs, both slower than dense everywhere:
v1 (Triton gate, down over N splits of every column: 42-60 us) and v2 (cuBLAS gate + one
kernel looping over all K and K_out per neuron chunk with fp32 atomics: 46.8 us, of which
~36 us did not depend on bytes).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from twell_compile.kernels import weight_cache

MAX_M = 256           # row blocks of <= 32 rows; the policy uses a smaller threshold
MAX_MB = 32           # rows per program: M-tiles of 64 would select Hopper's wgmma, which gave
                      # wrong results at M_P=64 in the first H200 run (Triton 3.6)


class Config(NamedTuple):
    bn: int        # neurons per gate/up program
    bk: int        # K step of the gate and up loops
    ks: int        # splits of K for the gate (programs per neuron block)
    e: int         # list entries per tl.dot in the down kernel
    bko: int       # K_out columns per down program
    splits: int    # down programs per K_out block (each takes every splits-th E entries)
    warps: int
    stages: int


# By padded M. Untuned starting points (the kernels were redesigned; benchmarks/tune_decode.py
# picks among VARIANTS on the device).
CONFIGS = {
    16: Config(32, 256, 1, 32, 128, 1, 4, 3),
    32: Config(32, 256, 1, 32, 128, 4, 4, 3),
    64: Config(32, 256, 1, 32, 128, 4, 4, 3),
    128: Config(32, 256, 1, 32, 128, 4, 4, 3),
    256: Config(32, 256, 1, 32, 128, 4, 4, 3),
}
SUM_BLOCK = 1024


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
    """The FFN for x2 [M, K], M <= MAX_M: gate (all of W_gate) and up (active W_up rows) in one
    kernel, down over the active W_down^T rows in a second. Three launches (one zero-fill of the
    counters, two kernels), four with split down partials."""
    from twell_compile.kernels.twell_decode import decode_down_kernel, decode_gate_up_kernel, decode_sum_kernel

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
    mb = min(mp, MAX_MB)
    nrb = -(-m // mb)
    wdt = weight_cache.transposed(w_down)
    bk = min(c.bk, max(16, _pow2(k)))
    ksl = -(-(-(-k // max(1, c.ks))) // bk) * bk          # K per split, a multiple of BK
    ks = -(-k // ksl)
    nb = -(-n // c.bn)
    # one zero-fill: per-token non-zeros [M], their total, list length per row block, split-K
    # tickets per (row block, neuron block), sum |h| (fp32 bits)
    ib = torch.zeros(m + 2 + nrb + nrb * nb, dtype=torch.int32, device=dev)
    tk = ib[m + 1 + nrb:m + 1 + nrb + nrb * nb]
    hs = ib[m + 1 + nrb + nrb * nb:].view(torch.float32)
    gp = torch.empty((ks, m, n), dtype=torch.float32, device=dev) if ks > 1 else ib
    idx = torch.empty(nrb * n, dtype=torch.int32, device=dev)
    hl = torch.empty((nrb * n, mb), dtype=dt, device=dev)
    wu = w_up if w_up is not None else w_gate
    decode_gate_up_kernel[(nb, ks, nrb)](
        x2, x2.stride(0), x2.stride(1), w_gate, w_gate.stride(0), w_gate.stride(1),
        b_gate if b_gate is not None else w_gate, wu, wu.stride(0), wu.stride(1),
        b_up if b_up is not None else w_gate, idx, hl, ib, hs, gp, tk, m, k, n, ksl,
        GATED=w_up is not None, HAS_BG=b_gate is not None, HAS_BU=b_up is not None,
        MB=mb, BN=c.bn, BK=bk, KS=ks, num_warps=c.warps, num_stages=c.stages)
    bko = min(c.bko, max(16, _pow2(k_out)))
    splits = max(1, c.splits)
    part = y if splits == 1 else torch.empty((splits, m, k_out), dtype=torch.float32, device=dev)
    bd = b_down if b_down is not None else y
    decode_down_kernel[(-(-k_out // bko), splits, nrb)](
        idx, hl, ib, wdt, wdt.stride(0), wdt.stride(1), bd, y, y.stride(0), y.stride(1), part,
        m, n, k_out, HAS_BD=b_down is not None, MB=mb, E=c.e, BKO=bko, S=splits,
        num_warps=c.warps, num_stages=c.stages)
    if splits > 1:
        decode_sum_kernel[(-(-(m * k_out) // SUM_BLOCK),)](
            part, bd, y, y.stride(0), y.stride(1), m, k_out,
            HAS_BD=b_down is not None, S=splits, BLOCK=SUM_BLOCK, num_warps=4)
    return Decoded(y, ib[:m + 1], hs)
