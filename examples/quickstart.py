"""Quickstart: a Llama-style model whose FFN activations are > 99% zero, compiled with
backend="twell" next to Inductor, on the machine it runs on.

Prints the explain report (which FFNs were rewritten, and why not), the error of both compiled
models against an fp64 reference (the product must stay within 2x of plain PyTorch's), and
tokens/s of the forward pass under torch.no_grad(), twell against Inductor, timed in
alternating rounds. The FFN weights are set as a ReLU model trained with an L1 penalty ends
up: gate pre-activations centred 2.6 standard deviations below zero, so ~0.5% of hidden units
fire per token (the paper's trained models: < 1%).

    python examples/quickstart.py            (or: make demo)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import twell_compile
from twell_compile import build


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
        self.gate_proj = nn.Linear(dim, hidden)
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
    def __init__(self, vocab: int, dim: int, heads: int, hidden: int, layers: int):
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


def sparsify(model: TinyLlama, sigmas: float = 2.6) -> None:
    """Gate rows of unit norm (pre-activations ~ N(0, 1) on RMS-normalised inputs) and a bias
    of -sigmas: P(gate > 0) = 0.47% at 2.6."""
    with torch.no_grad():
        for block in model.layers:
            w = block.mlp.gate_proj.weight
            w.copy_(F.normalize(torch.randn_like(w), dim=1))
            block.mlp.gate_proj.bias.fill_(-sigmas)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


def timed(fn, x, rounds: int, calls: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / calls)
    return out


def demo_model(device: str, layers: int = 2) -> tuple[TinyLlama, torch.Tensor]:
    """The demo's model (eval mode, sparsified) and tokens for ``device``.

    Shapes where the rewrite runs: on a CPU fp32, K = dim = 1024 features (the CPU record,
    runtime/arch.py, runs the C++ kernel from K >= 512 at any token count; runtime/select.py's
    plan_infer applies it per call); on CUDA bf16 and 4 x 2048 = 8192 tokens of K = 2048, where
    the per-row TwELL path runs (the record's min_tokens and min_width)."""
    cuda = device == "cuda"
    dim, hidden, tokens_shape, dtype = ((2048, 5632, (4, 2048), torch.bfloat16) if cuda
                                        else (1024, 2816, (1, 512), torch.float32))
    torch.manual_seed(0)
    model = TinyLlama(1024, dim, 8, hidden, layers).to(device, dtype).eval()
    sparsify(model)
    return model, torch.randint(0, 1024, tokens_shape, device=device)


def timing_line(total_s: float, compile_s: float, built: dict[str, float]) -> str:
    """The demo's last line: its time, the compile time, and any C++ build this run made
    (build.built_this_run(): module -> seconds; a later run loads the cached build)."""
    builds = "".join(f"; building the C++ kernel {module}, first run only: {secs:.0f} s"
                     for module, secs in built.items())
    return f"demo took {total_s:.0f} s (compiling both models: {compile_s:.0f} s{builds})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    t_start = time.perf_counter()
    model, tokens = demo_model(args.device, args.layers)
    dtype = next(model.parameters()).dtype

    with torch.no_grad():
        print(twell_compile.explain(model, tokens))
        torch._dynamo.reset()
        twell = torch.compile(model, backend="twell")
        inductor = torch.compile(model, backend="inductor")
        t0 = time.perf_counter()
        y_twell = twell(tokens)
        y_ind = inductor(tokens)
        compile_s = time.perf_counter() - t0
        ref = model.double()(tokens)
        model.to(dtype)
        y_eager = model(tokens)
        print(f"\nerror vs fp64: twell {rel_err(y_twell, ref):.2e}, Inductor {rel_err(y_ind, ref):.2e}, "
              f"eager {rel_err(y_eager, ref):.2e}   (rule: twell <= 2x eager)")

        calls = 3 if not cuda else 20
        t_tw, t_ind = [], []
        for _ in range(args.rounds):             # alternate: load on a shared machine hits both
            t_tw += timed(twell, tokens, 1, calls)
            t_ind += timed(inductor, tokens, 1, calls)
        n_tok = tokens.numel()
        tw, ind = statistics.median(t_tw), statistics.median(t_ind)
        print(f"forward, {n_tok} tokens, {args.layers} layers, {str(dtype).replace('torch.', '')} on "
              f"{torch.cuda.get_device_name() if cuda else 'CPU'}: twell {n_tok / tw:,.0f} tokens/s, "
              f"Inductor {n_tok / ind:,.0f} tokens/s: {ind / tw:.2f}x")
    stats = twell_compile.layer_stats()
    for name, s in stats.items():
        print(f"{name}: {s.mean_nnz:.1f} of {s.hidden} hidden units active per token "
              f"({100 * s.mean_nnz / s.hidden:.2f}%)")
    print("\n" + timing_line(time.perf_counter() - t_start, compile_s, build.built_this_run()))


if __name__ == "__main__":
    main()
