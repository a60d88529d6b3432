"""Test and benchmark inputs: the synthetic sparse FFN of the paper's anchors (one place; tests,
benchmarks and the training benches use it).

    x  = randn(M, K) * exp(tail * randn(M, 1));  x[:, 0] = 1        # channel 0 acts as a bias
    Wg = randn(N, K) / sqrt(K - 1);  Wg[:, 0] = -Phi^-1(1 - density)
    Wu = randn(N, K) / sqrt(K);      Wd = randn(K, N) / sqrt(N * density)

Drawn in fp32 on ``device`` from a seeded generator, then cast. Phi^-1(1 - density) is
clamped to Phi^-1(1e-6) at density 1.0 (the exact value is -inf: every gate would be +inf).
"""

from __future__ import annotations

import json
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


def load_profile(path: str, layer: str | None = None) -> tuple[str, dict]:
    """One layer of a non-zeros-per-token profile written by examples/train_sparse_lm.py
    (--profile-out). ``layer=None`` picks the layer with the highest mean density."""
    layers = json.load(open(path))["layers"]
    if layer is None:
        layer = max(layers, key=lambda name: layers[name]["density"])
    if layer not in layers:
        raise ValueError(f"layer {layer!r} not in {path}; it has {sorted(layers)}")
    return layer, layers[layer]


def make_ffn_profile(m: int, k: int, n: int, profile: dict, *, gated: bool = True,
                     dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
                     seed: int = 0) -> dict[str, Tensor | None]:
    """Like ``make_ffn`` but each token's density is drawn from a measured profile.

    Token m gets density d_m = nnz / hidden with nnz drawn from the profile's histogram (the
    fraction carries over to another N). The anchors generator makes the gate pre-activation
    x[m, 0] * Wg[:, 0] + z with z ~ N(0, ~1) and Wg[:, 0] = -Phi^-1(1 - d_ref), so
    x[m, 0] = Phi^-1(d_m) / Wg[:, 0] gives P(gate > 0) = d_m for that token.
    """
    d_ref = max(float(profile["density"]), 1e-6)
    p = make_ffn(m, k, n, d_ref, 0.0, gated=gated, dtype=torch.float32, device=device, seed=seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    counts = torch.tensor(profile["hist_counts"], dtype=torch.float64)
    values = torch.tensor(profile["hist_values"], dtype=torch.float64)
    d_m = values[torch.multinomial(counts, m, replacement=True, generator=g)] / int(profile["hidden"])
    d_m = d_m.clamp(1e-6, 1 - 1e-6)
    x0 = torch.special.ndtri(d_m) / gate_shift(d_ref)
    p["x"][:, 0] = x0.to(device=p["x"].device, dtype=torch.float32)
    return {k_: (None if t is None else t.to(dtype)) for k_, t in p.items()}
