"""The synthetic sparse FFN of ../shared/reference/anchors.md (one place; training benches reuse it).

    x  = randn(M, K) * exp(tail * randn(M, 1));  x[:, 0] = 1        # channel 0 acts as a bias
    Wg = randn(N, K) / sqrt(K - 1);  Wg[:, 0] = -Phi^-1(1 - density)
    Wu = randn(N, K) / sqrt(K);      Wd = randn(K, N) / sqrt(N * density)

Drawn in fp32 on ``device`` from a seeded generator, then cast. Phi^-1(1 - density) is
clamped to Phi^-1(1e-6) at density 1.0 (the exact value is -inf: every gate would be +inf).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def gate_shift(density: float) -> float:
    q = min(max(1.0 - density, 1e-6), 1.0 - 1e-6)
    return -float(torch.special.ndtri(torch.tensor(q, dtype=torch.float64)))


def make_ffn(m: int, k: int, n: int, density: float, tail: float = 0.0, *, gated: bool = True,
             dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
             seed: int = 0) -> dict[str, Tensor | None]:
    """x [M, K], w_gate/w_up [N, K], w_down [K, N] (nn.Linear layout), biases None."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32)

    x = randn(m, k) * torch.exp(tail * randn(m, 1))
    x[:, 0] = 1.0
    wg = randn(n, k) / math.sqrt(k - 1)
    wg[:, 0] = gate_shift(density)
    wu = randn(n, k) / math.sqrt(k) if gated else None
    wd = randn(k, n) / math.sqrt(n * density)
    cast = (lambda t: None if t is None else t.to(dtype))
    return {"x": cast(x), "w_gate": cast(wg), "b_gate": None, "w_up": cast(wu), "b_up": None,
            "w_down": cast(wd), "b_down": None}
