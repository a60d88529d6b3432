"""FFN modules built from a variant spec: every spelling of linear, ReLU, mul, split and dropout.

``build(spec)`` returns an ``nn.Module`` computing ``down(relu(gate(x)) * up(x))`` (gated) or
``down(relu(up(x)))`` written the way ``spec`` says, with squared ReLU (``act="relu2"``, the
square spelled as ``spec.square`` says) or dReLU (``act="drelu"``: relu(gate) * relu(up)). Used by the hypothesis tests of the
matcher and the rewrite; ``specs()`` is the strategy over the whole variant space.
``NearMiss`` holds the parameters (K -> N -> K) for the near-miss bodies the matcher's tests
write out, each ``body(module, x, x2)``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

LINEARS = ("F.linear", "torch._C._nn.linear", "nn.Linear", "x@w.t()", "x@w.T", "torch.matmul(x,w.t())",
           "x@W", "addmm")
RELUS = ("F.relu", "torch.relu", "Tensor.relu", "relu_", "F.relu(inplace)", "nn.ReLU")
MULS = ("*", "torch.mul", "Tensor.mul")
SPLITS = (None, "chunk", "split", "slice")
DROPOUTS = (None, "eval", "p0")
ACTS = ("relu", "relu2", "drelu")
SQUARES = ("**2", "**2.0", "torch.pow", "Tensor.pow", "torch.square", "Tensor.square", "relu*relu", "ReLUSquared")


@dataclass(frozen=True)
class Spec:
    linear: str = "F.linear"
    bias: bool = False
    relu: str = "F.relu"
    mul: str = "*"
    relu_first: bool = True        # relu(gate) * up, else up * relu(gate)
    gated: bool = True
    split: str | None = None       # fused gate+up projection, split how
    dropout: str | None = None     # identity dropout between the relu/product and down
    k: int = 8
    n: int = 12
    k_out: int = 8
    batch: tuple[int, ...] = (5,)  # token dims: (M,) -> 2-D input, (B, T) -> 3-D input
    act: str = "relu"              # "relu2": squared ReLU; "drelu": relu(gate) * relu(up) (gated)
    square: str = "**2"            # act="relu2": how the square is spelled

    def describe(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())


class Proj(nn.Module):
    """One linear map x -> x W^T + b, spelled as ``kind`` says."""

    def __init__(self, kind: str, k: int, n: int, bias: bool):
        super().__init__()
        self.kind = kind
        if kind == "nn.Linear":
            self.lin = nn.Linear(k, n, bias=bias)
            return
        stored = (k, n) if kind in ("x@W", "addmm") else (n, k)
        self.weight = nn.Parameter(torch.randn(stored) / k ** 0.5)
        self.bias = nn.Parameter(torch.randn(n) / 4) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind, w, b = self.kind, getattr(self, "weight", None), getattr(self, "bias", None)
        if kind == "nn.Linear":
            return self.lin(x)
        if kind == "F.linear":
            return F.linear(x, w, b)
        if kind == "torch._C._nn.linear":
            return torch._C._nn.linear(x, w, b)
        if kind == "addmm":
            # GPT-2's Conv1D: flatten tokens, addmm with the [in, out] weight, view back.
            shape = x.shape[:-1] + (w.shape[1],)
            x2 = x.view(-1, x.shape[-1])
            y = torch.addmm(b, x2, w) if b is not None else torch.mm(x2, w)
            return y.view(shape)
        if kind == "x@w.t()":
            y = x @ w.t()
        elif kind == "x@w.T":
            y = x @ w.T
        elif kind == "torch.matmul(x,w.t())":
            y = torch.matmul(x, w.t())
        elif kind == "x@W":
            y = x @ w
        else:
            raise ValueError(kind)
        return y + b if b is not None else y


def relu(kind: str, h: torch.Tensor) -> torch.Tensor:
    if kind == "F.relu":
        return F.relu(h)
    if kind == "torch.relu":
        return torch.relu(h)
    if kind == "Tensor.relu":
        return h.relu()
    if kind == "relu_":
        return h.relu_()
    if kind == "F.relu(inplace)":
        return F.relu(h, inplace=True)
    raise ValueError(kind)


def mul(kind: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if kind == "*":
        return operator.mul(a, b)
    if kind == "torch.mul":
        return torch.mul(a, b)
    if kind == "Tensor.mul":
        return a.mul(b)
    raise ValueError(kind)


class ReLUSquared(nn.Module):
    """transformers' ACT2FN["relu2"] (ReLUSquaredActivation), copied: F.relu then torch.square."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(h))


def square(kind: str, h: torch.Tensor) -> torch.Tensor:
    if kind == "**2":
        return h ** 2
    if kind == "**2.0":
        return h ** 2.0
    if kind == "torch.pow":
        return torch.pow(h, 2)
    if kind == "Tensor.pow":
        return h.pow(2)
    if kind == "torch.square":
        return torch.square(h)
    if kind == "Tensor.square":
        return h.square()
    raise ValueError(kind)


class FFN(nn.Module):
    def __init__(self, spec: Spec):
        super().__init__()
        self.spec = spec
        s = spec
        if s.gated and s.split:
            self.gate_up = Proj(s.linear, s.k, 2 * s.n, s.bias)
        else:
            self.gate = Proj(s.linear, s.k, s.n, s.bias)
            if s.gated:
                self.up = Proj(s.linear, s.k, s.n, s.bias)
        self.down = Proj(s.linear, s.n, s.k_out, s.bias)
        self.act = nn.ReLU() if s.relu == "nn.ReLU" else None
        self.squared = ReLUSquared() if s.act == "relu2" and s.square == "ReLUSquared" else None
        self.drop = nn.Dropout(0.0 if s.dropout == "p0" else 0.3) if s.dropout else None

    def _relu(self, h: torch.Tensor) -> torch.Tensor:
        return self.act(h) if self.act is not None else relu(self.spec.relu, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if s.gated and s.split:
            gu = self.gate_up(x)
            if s.split == "chunk":
                g, u = gu.chunk(2, dim=-1)
            elif s.split == "split":
                g, u = gu.split(s.n, dim=-1)
            else:
                g, u = gu[..., :s.n], gu[..., s.n:]
        else:
            g = self.gate(x)
            u = self.up(x) if s.gated else None
        if s.act == "relu2" and self.squared is not None:
            h = self.squared(g)
        elif s.act == "relu2" and s.square == "relu*relu":
            h = self._relu(g) * self._relu(g)
        elif s.act == "relu2":
            h = square(s.square, self._relu(g))
        else:
            h = self._relu(g)
        if u is not None and s.act == "drelu":
            u = self._relu(u)
        if u is not None:
            h = mul(s.mul, h, u) if s.relu_first else mul(s.mul, u, h)
        if self.drop is not None:
            h = self.drop(h)
        return self.down(h)


def eager_allows(spec: Spec, needs_grad: bool) -> bool:
    """Eager autograd refuses an in-place ReLU on an output of ``chunk``/``split`` (multi-output
    views) when a gradient is recorded: such a module is invalid code, not a variant."""
    inplace = spec.relu in ("relu_", "F.relu(inplace)")
    if spec.act == "relu2" and spec.square == "relu*relu" and inplace:
        return False      # relu_(g) * relu_(g): eager squares, but the matcher leaves two writes of g alone
    if needs_grad and inplace and spec.act == "drelu" and spec.split:
        return False      # relu_ on both slices of one tensor: autograd refuses the second write
    return not (needs_grad and inplace and spec.gated and spec.split in ("chunk", "split"))


def build(spec: Spec, dtype: torch.dtype = torch.float32, seed: int = 0) -> FFN:
    torch.manual_seed(seed)
    m = FFN(spec).to(dtype)
    return m.eval()


@st.composite
def specs(draw, linears=LINEARS) -> Spec:
    gated = draw(st.booleans())
    batch = draw(st.sampled_from([(draw(st.integers(1, 9)),), (draw(st.integers(1, 3)), draw(st.integers(1, 7)))]))
    return Spec(
        linear=draw(st.sampled_from(linears)),
        bias=draw(st.booleans()),
        relu=draw(st.sampled_from(RELUS)),
        mul=draw(st.sampled_from(MULS)),
        relu_first=draw(st.booleans()),
        gated=gated,
        split=draw(st.sampled_from(SPLITS)) if gated else None,
        dropout=draw(st.sampled_from(DROPOUTS)),
        act=(act := draw(st.sampled_from(ACTS if gated else ACTS[:2]))),
        square=draw(st.sampled_from(SQUARES)) if act == "relu2" else "**2",
        k=draw(st.integers(1, 19)),
        n=draw(st.integers(1, 23)),
        k_out=draw(st.integers(1, 17)),
        batch=batch,
    )


K, N = 8, 12


class NearMiss(nn.Module):
    """Parameters for a near-miss body ``body(module, x, x2)``: gate, up, down, and a spare fused
    gate+up projection."""

    def __init__(self, body):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(K, N), nn.Linear(K, N), nn.Linear(N, K)
        self.fused = nn.Linear(K, 2 * N)
        self.body = body

    def forward(self, x, x2):
        return self.body(self, x, x2)


__all__ = ["Spec", "FFN", "Proj", "build", "eager_allows", "specs", "LINEARS", "RELUS", "MULS", "SPLITS", "DROPOUTS",
           "ACTS", "SQUARES", "replace", "K", "N", "NearMiss"]
