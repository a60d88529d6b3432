"""Session 11's split per-row path, kept here as a measured negative result (not shipped).

Host side of ``twell_split.py`` (its device code, next to this file) with the per-row kernel's
FIX mode (``twell_rows_fix.py``: only rows over W or with non-finite x). H200, M=16384,
K=2048, N=5632, d=0.005 (``probe_split1.log``): 11.9-24.9 ms against the fused per-row
kernel's 0.50 ms. One program per weight slice streams every token past it; each step is a
chain of dependent global loads (counts, list, then the gather), so a program is latency-bound
(~6 us per step of 8 tokens) and the L1 carveout made no difference. Keeping the slices in
fast memory needs many independent warps per SM on one slice (CUDA C++ with shared memory),
not one Triton program per slice.

    python3 benchmarks/results/h200/session11/split/probe_split.py OUT.json   # needs the
    # shipped cuda_infer of commit ff3dea4 (the probe calls cuda_infer.split_rows)
"""
from typing import Optional

import torch
from torch import Tensor

from twell_compile.kernels import weight_cache
from twell_compile.kernels.cuda_infer import ROW_PAIRS, ROW_PF, ROW_WARPS, TAIL_CH, Rows, _pow2

# split path (twell_split.py): weight slices resident in L1, see there
SPLIT_KS = 64          # up: K columns per program
SPLIT_NR = 1408        # up: neurons per program (KS x NR x 2 bytes: 176 KB at bf16)
SPLIT_UBT = 8          # up: tokens per step
SPLIT_UP = 4           # up: pairs per token per step
SPLIT_ULP = 32         # up: list entries per step of the range scan
SPLIT_UWARPS = 4
SPLIT_SL = 16          # down: K_out columns per program (N x SL x 2 bytes: 176 KB at N=5632)
SPLIT_DBT = 8          # down: tokens per step
SPLIT_DP = 8           # down: pairs per token per step
SPLIT_DWARPS = 4
SPLIT_CHUNKS = 1       # token chunks per weight slice (programs = slices x chunks)


def split_rows(x2: Tensor, r: Rows, w_up: Optional[Tensor], b_up: Optional[Tensor],
               w_down: Tensor, b_down: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(y [M, K_out], sum |h| per row [M] fp32) from the per-row lists, by the split kernels
    (twell_split.py) and the per-row kernel for rows over W or with non-finite x."""
    from twell_rows_fix import twell_rows_kernel
    from twell_split import split_down_kernel, split_up_kernel

    m, k = x2.shape
    n, k_out = r.g.shape[1], w_down.shape[0]
    width = r.lst.shape[1]
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    wdt = weight_cache.transposed(w_down)
    y = torch.empty((m, k_out), dtype=x2.dtype, device=x2.device)
    hsum = torch.empty((m,), dtype=torch.float32, device=x2.device)
    if m == 0:
        return y, hsum
    gated = w_up is not None
    buf = torch.zeros((m * width + m) if gated else m, dtype=torch.int32, device=x2.device)
    flag = buf[:m]                       # rows with non-finite x (set by the up kernel)
    uacc = buf[m:].view(torch.float32)   # u per listed pair [M, W] (gated)
    chunks = max(1, min(SPLIT_CHUNKS, m))
    tc = -(-m // chunks)
    if gated:
        nks, nr = -(-k // SPLIT_KS), -(-n // SPLIT_NR)
        launch_up = split_up_kernel[(nks * nr * chunks,)]
        launch_up(x2, x2.stride(0), r.lst, r.cnt, w_up, w_up.stride(0), uacc, flag,
                  m, k, n, width, nks, nr, tc, KS=SPLIT_KS, NR=SPLIT_NR, BT=SPLIT_UBT, P=SPLIT_UP,
                  LP=SPLIT_ULP, num_warps=SPLIT_UWARPS)
    nsl = -(-k_out // SPLIT_SL)
    split_down_kernel[(nsl * chunks,)](
        r.lst, r.cnt, uacc, b_up if b_up is not None else y, wdt, wdt.stride(0),
        b_down if b_down is not None else y, y, y.stride(0), hsum, m, k_out, width, nsl, tc,
        GATED=gated, HAS_BU=b_up is not None, HAS_BD=b_down is not None, SL=SPLIT_SL,
        BT=SPLIT_DBT, P=SPLIT_DP, num_warps=SPLIT_DWARPS)
    wu = w_up if gated else wdt
    kp = _pow2(max(k, k_out))
    twell_rows_kernel[(m,)](
        x2, x2.stride(0), x2.stride(1), r.g, r.g.stride(0), r.lst, r.cnt,
        wu, wu.stride(0), wu.stride(1), b_up if b_up is not None else x2,
        wdt, wdt.stride(0), wdt.stride(1), b_down if b_down is not None else x2,
        y, y.stride(0), y.stride(1), hsum, flag, k, n, k_out, width,
        GATED=gated, HAS_BU=b_up is not None, HAS_BD=b_down is not None,
        K_P=_pow2(k), KO_P=_pow2(k_out), PAIRS=ROW_PAIRS, CH=min(TAIL_CH, _pow2(n)), PF=ROW_PF,
        FIX=True, num_warps=ROW_WARPS or (8 if kp > 2048 else 4))
    return y, hsum


