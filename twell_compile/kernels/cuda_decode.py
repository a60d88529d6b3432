"""Host side of the decode path (kernels/twell_decode.py): few tokens, bf16/fp16.

For x [M, K] with M <= MAX_M: the gate GEMV by cuBLAS (all of W_gate), then one Triton kernel
that reads W_up rows (contiguous in nn.Linear's [N, K] layout) and W_down^T rows ([N, K_out],
made once per weight by ``weight_cache``) for the neurons active in any row only, and a small
finishing kernel. No host sync, fixed launch shapes per M: CUDA-graph capturable. Exact at any
density: a neuron is skipped only where relu(g) is 0 in every row of its row block and no
row of x holds NaN/Inf.

First design (gate GEMV in Triton, down partials per N split, no atomics), replaced after its
H200 run: 42-60 us per layer at K=2048, N=5632, M=1..32 vs dense 34 us (0.6-0.8x): the Triton
gate read 23 MB far slower than cuBLAS, and the down kernel's dependent h -> W_d^T loads ran in
many short, smem-limited waves (time grew with its program count: 704 -> 2816 programs,
42 -> 72 us).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from twell_compile.kernels import weight_cache

MAX_M = 256           # row blocks of <= 32 rows; the policy uses a smaller threshold
MAX_MB = 32           # rows per program: M-tiles of 64 would select Hopper's wgmma, which gave
                      # wrong results at M_P=64 in the first H200 run (Triton 3.6)


class Config(NamedTuple):
    ch: int        # neurons per program
    bk: int        # K step of the up loop
    bko: int       # K_out step of the down loop
    warps: int
    stages: int
    ksplit: int    # programs per chunk along K_out (each recomputes the chunk's u from L2)


# By padded M: the winners of benchmarks/tune_decode.py on H200 (results/h200/decode_run2/
# tune.log; K=2048 N=5632 M=1, d 0.005: 46.9 us vs 38.6-54.5 us for the other variants, best
# mean over both shapes). 128 and 256 (M above the policy's threshold) untuned.
CONFIGS = {
    16: Config(128, 64, 128, 4, 3, 1),
    32: Config(128, 64, 128, 4, 3, 1),
    64: Config(128, 64, 128, 4, 3, 1),
    128: Config(64, 128, 128, 4, 3, 1),
    256: Config(64, 128, 128, 4, 3, 1),
}
FINISH_BLOCK = 1024


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
    """The FFN for x2 [M, K], M <= MAX_M: cuBLAS gate GEMV, then W_up / W_down rows of active
    neurons only. Four launches: gate GEMM, zero-fill of the fp32 accumulator, sparse kernel,
    finish."""
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
    g = F.linear(x2, w_gate, b_gate)                      # eager's gate GEMM (cuBLAS)
    wdt = weight_cache.transposed(w_down)
    acc = torch.zeros((m, k_out), dtype=torch.float32, device=dev)
    return _launch(x2, g, w_up, b_up, wdt, b_down, y, acc, c, m, k, n, k_out, mp)


def _launch(x2: Tensor, g: Tensor, w_up: Optional[Tensor], b_up: Optional[Tensor], wdt: Tensor,
            b_down: Optional[Tensor], y: Tensor, acc: Tensor, c: Config,
            m: int, k: int, n: int, k_out: int, mp: int) -> Decoded:
    from twell_compile.kernels.twell_decode import decode_ffn_kernel, decode_finish_kernel

    dev = x2.device
    mb = min(mp, MAX_MB)
    nrb = -(-m // mb)
    nb = -(-n // c.ch)
    bko = min(c.bko, max(16, _pow2(k_out)))
    ksplit_len = -(-(-(-k_out // c.ksplit)) // bko) * bko
    ksplit = -(-k_out // ksplit_len)
    hs = torch.empty(nb * nrb + 1, dtype=torch.float32, device=dev)
    i32 = torch.empty(nb * m + m + 1, dtype=torch.int32, device=dev)
    cnt, tok = i32[: nb * m], i32[nb * m:]
    wu = w_up if w_up is not None else g
    decode_ffn_kernel[(nb, nrb, ksplit)](
        x2, x2.stride(0), x2.stride(1), g, g.stride(0),
        wu, wu.stride(0), wu.stride(1), b_up if b_up is not None else x2,
        wdt, wdt.stride(0), wdt.stride(1),
        acc, cnt, hs, m, k, n, k_out, ksplit_len,
        GATED=w_up is not None, HAS_BU=b_up is not None,
        MB=mb, CH=c.ch, BK=min(c.bk, max(16, _pow2(k))), BKO=bko,
        num_warps=c.warps, num_stages=c.stages)
    nb_ch = max(1, min(_pow2(max(nb, nb * nrb)), 8192 // mp))
    decode_finish_kernel[(-(-(m * k_out) // FINISH_BLOCK) + 1,)](
        acc, b_down if b_down is not None else x2, y, y.stride(0), y.stride(1),
        cnt, hs, tok, hs[-1:], m, k_out, nb, nb * nrb,
        HAS_BD=b_down is not None, BLOCK=FINISH_BLOCK, M_P=mp, NB_CH=nb_ch, num_warps=4)
    return Decoded(y, tok, hs[-1:])
