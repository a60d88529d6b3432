"""The synthetic sparse FFN of docs/anchors (shared/reference/anchors.md), on any device and dtype.

    x  = randn(M, K) * exp(tail * randn(M, 1));  x[:, 0] = 1        # channel 0 acts as a bias
    Wg = randn(N, K) / sqrt(K - 1);  Wg[:, 0] = -Phi^-1(1 - density)
    Wu = randn(N, K) / sqrt(K);      Wd = randn(K, N) / sqrt(N * density)

Returns nn.Linear-layout weights: w_gate, w_up [N, K], w_down [K, N]; y = (relu(x Wg^T) * (x Wu^T)) Wd^T.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch
from torch import Tensor


def make_ffn(m: int, k: int, n: int, density: float, tail: float = 0.0, dtype: torch.dtype = torch.float32,
             device: str = "cpu", seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x [M, K], w_gate [N, K], w_up [N, K], w_down [K, N]), generated in fp32 then cast."""
    if not 0.0 < density < 1.0:
        raise ValueError(f"density must be in (0, 1), got {density}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(tail * torch.randn(m, 1, generator=g))
    x[:, 0] = 1.0
    w_gate = torch.randn(n, k, generator=g) / math.sqrt(k - 1)
    w_gate[:, 0] = -NormalDist().inv_cdf(1.0 - density)
    w_up = torch.randn(n, k, generator=g) / math.sqrt(k)
    w_down = torch.randn(k, n, generator=g) / math.sqrt(n * density)
    return tuple(t.to(device=device, dtype=dtype) for t in (x, w_gate, w_up, w_down))
