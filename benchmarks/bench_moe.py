"""The MoE speed row: one transformers Mixtral MoE block (router + experts, ``experts_implementation``
"grouped_mm", the default) with ReLU experts at a set gate density, compiled with
``backend="inductor"`` and with ``backend="twell"`` on the same weights and tokens.

    python3 benchmarks/bench_moe.py                      # 8 experts, top-2, d=0.005, 16k tokens, bf16, CUDA
    python3 benchmarks/bench_moe.py --tiny               # CPU-sized smoke run (tests)
    python3 benchmarks/bench_moe.py --train              # forward + backward

The density: the block's input carries a constant-1 feature 0 and every expert's gate rows
take the bias-free ``testing.make_ffn`` shift there, so each expert's ReLU fires on about a
``--density`` fraction of its hidden units for the tokens routed to it (the row records the
measured density, from ``layer_stats``). The router stays Inductor's in both runs; twell
replaces the experts' grouped matmuls with ``twell::experts``. Each row: ms per call for both
backends, the ratio, the routed rows per expert, the max error of twell's output against
Inductor's. Rows go to runs/<gpu>/moe.json unless ``--out`` names a file. Without
``--rewrite-all`` on CUDA the compile-time rule leaves grouped experts to Inductor (they run
expert by expert: results/h200/moe.json), so the run stops with explain's reason.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rows import gpu_label, out_path, stamp, write_json  # noqa: E402
from twell_compile.testing import gate_shift  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized config (tests): K=32, N=64, 64 tokens, fp32")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=None, help="K (default 2048)")
    ap.add_argument("--ffn", type=int, default=None, help="each expert's N (default 5632)")
    ap.add_argument("--tokens", type=int, default=None, help="default 16384")
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    ap.add_argument("--device", default=None, help="default cuda when available, else cpu")
    ap.add_argument("--train", action="store_true", help="time forward + backward")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per backend (default 50; --tiny 3)")
    ap.add_argument("--rewrite-all", action="store_true",
                    help="twell.skip_dense=False: rewrite even where the compile-time rule expects dense to win "
                         "(on with --tiny)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    a.rewrite_all = a.rewrite_all or a.tiny
    tiny = dict(hidden=32, ffn=64, tokens=64, dtype="float32", reps=3) if a.tiny else {}
    full = dict(hidden=2048, ffn=5632, tokens=16384, dtype="bfloat16", reps=50)
    for key, value in full.items():
        if getattr(a, key) is None:
            setattr(a, key, tiny.get(key, value))
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return a


def build_block(a: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    """A Mixtral sparse MoE block with ReLU experts whose gates fire at about ``a.density``."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = transformers.MixtralConfig(hidden_size=a.hidden, intermediate_size=a.ffn, num_local_experts=a.experts,
                                        num_experts_per_tok=a.top_k, hidden_act="relu")
    config._experts_implementation = "grouped_mm"
    g = torch.Generator().manual_seed(0)
    block = MixtralSparseMoeBlock(config)
    k, n = a.hidden, a.ffn
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(a.experts, k, generator=g) / math.sqrt(k))
        up = torch.randn(a.experts, 2 * n, k, generator=g) / math.sqrt(k - 1)
        up[:, :n, 0] = gate_shift(a.density)
        block.experts.gate_up_proj.copy_(up)
        block.experts.down_proj.copy_(torch.randn(a.experts, k, n, generator=g) / math.sqrt(n * a.density))
    return block.to(device=a.device, dtype=dtype)


def tokens(a: argparse.Namespace, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, a.tokens, a.hidden, generator=g)
    x[..., 0] = 1.0
    return x.to(device=a.device, dtype=dtype)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], reps: int, device: str) -> float:
    """Median ms of ``fn`` over ``reps`` calls after two warm-up calls (host clock, synced)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def explain_table(block: torch.nn.Module, x: torch.Tensor, a: argparse.Namespace) -> str:
    """``twell_compile.explain``'s report for the block on these tokens, with the twell run's
    options and grad mode (what the backend matched, what it left and why)."""
    import twell_compile

    options = {"twell.skip_dense": False} if a.rewrite_all else None
    torch._dynamo.reset()
    with torch.set_grad_enabled(a.train):
        report = twell_compile.explain(block, x, options=options)
    text = str(report)
    if not report.rewrites and not report.rejections:
        text += "\nno FFN-shaped block in the graph; Dynamo's calls:\n" + graph_calls(block, x, a)
    return text


def graph_calls(block: torch.nn.Module, x: torch.Tensor, a: argparse.Namespace) -> str:
    """The calls of the Dynamo graph(s) of ``block(x)``, one a line (``name = target(args)``): what
    the matcher was given."""
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.set_grad_enabled(a.train):
        torch.compile(block, backend=record)(x)
    torch._dynamo.reset()
    lines = []
    for gm in graphs:
        for n in gm.graph.nodes:
            if n.op in ("call_function", "call_method", "call_module"):
                target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
                args = ", ".join([str(v) for v in n.args] + [f"{k}={v}" for k, v in n.kwargs.items()])
                lines.append(f"  {n.name} = {target}({args})")
    return "\n".join(lines)


def run(a: argparse.Namespace) -> dict:
    import twell_compile

    dtype = getattr(torch, a.dtype)
    block = build_block(a, dtype)
    x = tokens(a, dtype)
    if a.train:
        x.requires_grad_()
    outs, ms = {}, {}
    for backend in ("inductor", "twell"):
        torch._dynamo.reset()
        twell_compile.reset_stats()
        options = {"twell.skip_dense": False} if backend == "twell" and a.rewrite_all else None
        compiled = torch.compile(block, backend=backend, options=options)

        def call(compiled=compiled):
            if a.train:
                y = compiled(x)
                y.float().square().mean().backward()
                return y
            with torch.no_grad():
                return compiled(x)

        outs[backend] = call().detach()
        ms[backend] = time_ms(call, a.reps, a.device)
        if backend == "twell":
            stats = twell_compile.layer_stats()
    if not stats:
        raise RuntimeError("twell rewrote no experts (no layer_stats; --rewrite-all overrides the compile-time "
                           f"speed rule). twell_compile.explain(block, x):\n{explain_table(block, x, a)}")
    routed = sum(s.tokens for s in stats.values())
    density = sum(s.mean_nnz * s.tokens for s in stats.values()) / max(routed * a.ffn, 1)
    err = (outs["twell"].double() - outs["inductor"].double()).abs().max().item()
    return stamp({"bench": "moe", "mode": "train" if a.train else "forward", "dtype": a.dtype,
                  "experts": a.experts, "top_k": a.top_k, "k": a.hidden, "n": a.ffn, "tokens": a.tokens,
                  "density_target": a.density, "density_measured": density,
                  "rows_per_expert": routed / max(len(stats), 1), "inductor_ms": ms["inductor"],
                  "twell_ms": ms["twell"], "speedup": ms["inductor"] / ms["twell"], "max_abs_err": err},
                 a.device)


def main(argv=None) -> int:
    a = parse_args(argv)
    row = run(a)
    path = out_path(a.out, gpu_label(a.device).replace(" ", "_").replace(":", ""), "moe.json")
    write_json(path, [row])
    print(f"MoE {a.experts} experts top-{a.top_k}, K={a.hidden} N={a.ffn}, {a.tokens} tokens, {a.dtype}, "
          f"d={row['density_measured']:.4f}: inductor {row['inductor_ms']:.3f} ms, twell {row['twell_ms']:.3f} ms "
          f"({row['speedup']:.2f}x), max |err| {row['max_abs_err']:.3g} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
