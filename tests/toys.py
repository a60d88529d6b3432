"""The toy models the tests share: a ReLU FFN in its three common spellings and a residual
block around any of them. Layer names in reports follow the attribute names here (``mlp``;
``gate``, ``up``, ``down``, ``gate_up``). A test that needs another spelling (a ReLU module,
raw matmuls, an extra user of h) defines it beside the test, since that spelling is the point."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class GatedMLP(nn.Module):
    """down(relu(gate(x)) * up(x)), Llama's FFN (without biases unless ``bias``)."""

    def __init__(self, k: int = 16, n: int = 40, bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(k, n, bias=bias)
        self.up = nn.Linear(k, n, bias=bias)
        self.down = nn.Linear(n, k, bias=bias)

    def forward(self, x):
        return self.down(F.relu(self.gate(x)) * self.up(x))

    @classmethod
    def at_density(cls, k: int, n: int, density: float) -> "GatedMLP":
        """Without biases, holding ``twell_compile.testing.make_ffn``'s weights at ``density``
        (fp32 on the CPU: move it with .cuda().to(dtype))."""
        from twell_compile.testing import make_ffn

        mlp = cls(k, n)
        p = make_ffn(8, k, n, density, 0.0, dtype=torch.float32)
        with torch.no_grad():
            for name in ("gate", "up", "down"):
                getattr(mlp, name).weight.copy_(p[f"w_{name}"])
        return mlp


class PlainMLP(nn.Module):
    """down(relu(up(x))), the non-gated FFN."""

    def __init__(self, k: int = 16, n: int = 40, bias: bool = False):
        super().__init__()
        self.up = nn.Linear(k, n, bias=bias)
        self.down = nn.Linear(n, k, bias=bias)

    def forward(self, x):
        return self.down(F.relu(self.up(x)))


class FusedMLP(nn.Module):
    """Phi-3's gated FFN: gate and up one projection, split by chunk."""

    def __init__(self, k: int = 16, n: int = 40, bias: bool = False):
        super().__init__()
        self.gate_up = nn.Linear(k, 2 * n, bias=bias)
        self.down = nn.Linear(n, k, bias=bias)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.relu(g) * u)


class Block(nn.Module):
    """A transformer block's FFN half: x + mlp(norm(x)), LayerNorm over ``k`` features (no norm
    with ``norm=False``)."""

    def __init__(self, mlp: nn.Module, k: int = 16, norm: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(k) if norm else nn.Identity()
        self.mlp = mlp

    def forward(self, x):
        return x + self.mlp(self.norm(x))
