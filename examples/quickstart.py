"""Quickstart: compile a small ReLU Llama-style model with backend="twell".

Prints which FFNs were rewritten (the explain report), then the largest difference between
the compiled model and eager PyTorch, for inference and for one training step with the
paper's L1 sparsity option. Runs on a CPU in well under a minute:

    python examples/quickstart.py            (or: make demo)
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import twell_compile


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    """Llama's gated FFN with a ReLU gate: down(relu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.relu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.heads = heads
        self.mlp = MLP(dim, hidden)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, hidden: int = 176, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()

    torch.manual_seed(0)
    model = TinyLlama(layers=args.layers).to(args.device)
    tokens = torch.randint(0, 256, (2, 32), device=args.device)

    print(twell_compile.explain(model, tokens))

    compiled = torch.compile(model, backend="twell")
    t0 = time.perf_counter()
    with torch.no_grad():
        diff = (compiled(tokens) - model(tokens)).abs().max().item()
    print(f"\ninference: max |compiled - eager| = {diff:.2e}   (compile + run {time.perf_counter() - t0:.1f} s)")

    # Training: gradients through our backward against eager autograd.
    def step(m):
        model.zero_grad()
        loss = F.cross_entropy(m(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        return loss, [p.grad.clone() for p in model.parameters()]

    _, ref = step(model)
    loss, got = step(torch.compile(model, backend="twell"))
    gdiff = max((a - b).abs().max().item() for a, b in zip(ref, got))
    print(f"training: max |grad compiled - grad eager| = {gdiff:.2e}")

    # The paper's L1 penalty folded into our backward: sparsity training with no loss change.
    step(torch.compile(model, backend="twell", options={"twell.l1": 2e-5}))
    for name, s in twell_compile.layer_stats().items():
        print(f"{name}: {s.mean_nnz:.1f} of {s.hidden} hidden units active per token "
              f"(max {s.max_nnz}), mean |h| {s.l1:.3g}")

if __name__ == "__main__":
    main()
