"""Decode-sized FFN (issue 7): dense eager vs twell, CUDA graphs for both. Run it as
``python3 benchmarks/bench_ffn.py --decode [flags]`` (or this file directly).

    python3 benchmarks/bench_ffn.py --decode                       # M 1..64 x 4 densities x 2 shapes
    python3 benchmarks/bench_ffn.py --decode --M 64 128 256 512 2048 8192 --density 0.005 \\
        --shapes 2048x5632 --out /tmp/crossover.json               # where each path wins

Per (shape, density) LAYERS weight sets are drawn (twell_compile/testing.py, bf16), enough that
one pass reads > ROTATE_MB of weights (several times the 50-60 MB L2): each timed CUDA graph
runs the FFN once per set, like consecutive layers of a model, and times are per layer
(replay median / LAYERS, triton.testing.do_bench). W_down^T copies are made up front, as the
backend does at compile time.
  dense_ms   eager's calls (ffn_dense), graph-captured
  twell_ms   torch.ops.twell.ffn as the backend calls it (policy included, warmed up so the
             layer's density has landed before capture): path says what it ran
  kernel_ms  the sparse kernels forced: decode path for M <= cuda_decode.MAX_M (each of its
             up/down forms timed, form_ms; kernel_ms is the fastest, kernel_form), else the
             per-row path (kernel column)
Bandwidth: peak_GBps is a 1 GiB device-to-device copy (read + write bytes) in the same run;
dense_GBps counts W_gate + W_up + W_down once; twell_GBps counts W_gate plus the W_up and
W_down^T rows of the neurons active in any of the M rows (union, measured per layer), for the
path the op ran. rel_err / dense_rel_err: ||y - y_fp32|| / ||y_fp32|| of the op and of eager
bf16 (fp32 reference with TF32 off). Writes benchmarks/results/<gpu>/ffn_decode.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from twell_compile.testing import make_ffn  # noqa: E402
from timing import gpu_name, median_ms, rel  # noqa: E402

import twell_compile.ops  # noqa: E402,F401  (registers torch.ops.twell)
from twell_compile.kernels import cuda_decode, cuda_infer, cuda_policy, weight_cache  # noqa: E402
from twell_compile.reference import ffn_dense  # noqa: E402

DECODE_M = [1, 2, 4, 8, 16, 32, 64]
DECODE_D = [0.005, 0.02, 0.05, 0.2]
DECODE_S = ["2048x5632", "4096x11008"]
ROTATE_MB = 256


def bench(fn, reps: int) -> float:
    return median_ms(fn, reps, warmup=max(5, reps // 4))


def peak_gbps(reps: int) -> float:
    """Device-to-device copy of 1 GiB: (read + write bytes) / median time."""
    a = torch.empty(1 << 29, dtype=torch.float16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a), reps)
    del a, b
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


def graph_ms(fn, reps: int) -> float:
    """fn captured in one CUDA graph (after warm-up calls on a side stream); median replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ms = bench(g.replay, reps)
    del g
    return ms


def weight_sets(m_max: int, k: int, n: int, density: float, tail: float, layers: int, seed: int) -> list[dict]:
    sets = []
    for r in range(layers):
        p = make_ffn(m_max, k, n, density, tail, device="cuda", seed=seed + r)
        weight_cache.register(p["w_down"])
        sets.append(p)
    return sets


def layers_for(k: int, n: int, k_out: int, gated: bool, rotate_mb: float) -> int:
    per = 2e-6 * n * (k * (2 if gated else 1) + k_out)
    return max(2, math.ceil(rotate_mb / per))


def run_point(sets, m: int, d: float, reps: int, tag: str) -> dict:
    k, n, k_out = sets[0]["w_gate"].shape[1], sets[0]["w_gate"].shape[0], sets[0]["w_down"].shape[0]
    gated = sets[0]["w_up"] is not None
    layers = len(sets)
    xs = [p["x"][:m].contiguous() for p in sets]
    args = [(x, p["w_gate"], None, p["w_up"], None, p["w_down"], None) for x, p in zip(xs, sets)]
    names = [f"{tag}/{m}/{r}" for r in range(layers)]

    def dense():
        for a in args:
            ffn_dense(*a)

    def op():
        for a, name in zip(args, names):
            torch.ops.twell.ffn(*a, 128, 16, name, False)

    for _ in range(3):                      # policy: first call probes, later calls decide
        op()
        torch.cuda.synchronize()
    key = (names[0], xs[0].device, xs[0].dtype, k, n, k_out, gated)
    if cuda_policy.decode_ok(xs[0], m, n):
        form = cuda_policy.use_decode(key, m, k, n, k_out, gated)
        path = "dense" if form is None else f"decode-{form}"
    elif cuda_policy.shape_ok(xs[0], m, k, k_out, n):
        path = "rows" if cuda_policy.use_twell(key, gated, k, n, k_out, xs[0].element_size()) else "dense"
    else:
        path = "dense"
    kname = "decode" if m <= cuda_decode.MAX_M else "rows"
    nnz = [float((F.linear(x, p["w_gate"]) > 0).sum()) / m for x, p in zip(xs, sets)]
    dense_ms = graph_ms(dense, reps) / layers
    twell_ms = graph_ms(op, reps) / layers
    a0 = args[0]
    form_ms = {}
    if kname == "decode":      # every up/down form the decode path has for this M, forced
        forms = [f for f in cuda_decode.FORMS
                 if f != "rows" or m <= cuda_decode.config_for(m, k).vec_m]
        for f in forms:
            form_ms[f] = graph_ms(lambda: [cuda_decode.decode_forward(*a, form=f) for a in args], reps) / layers
        kform = min(form_ms, key=form_ms.get)
        kernel_ms = form_ms[kform]
        y_k = cuda_decode.decode_forward(*a0, form=kform).y
    else:
        kform = None
        widths = [cuda_infer.list_width(n, v) for v in nnz]
        kernel_ms = graph_ms(lambda: [cuda_infer.twell_forward(*a, width=w) for a, w in zip(args, widths)],
                             reps) / layers
        y_k = cuda_infer.twell_forward(*a0, width=widths[0])[0]
    # accuracy (layer 0, fresh outputs)
    ref = ffn_dense(*(None if t is None else t.float() for t in a0))
    y_op = torch.ops.twell.ffn(*a0, 128, 16, names[0], False)
    union = sum(float((F.linear(x, p["w_gate"]) > 0).any(0).sum()) for x, p in zip(xs, sets)) / layers
    g = 1 if gated else 0
    dense_bytes = 2 * n * (k * (1 + g) + k_out)
    dec_bytes = 2 * (n * k + union * (g * k + k_out))
    op_bytes = dec_bytes if path.startswith("decode") else dense_bytes
    return dict(M=m, K=k, N=n, density=d, dense_ms=dense_ms, twell_ms=twell_ms, kernel_ms=kernel_ms,
                kernel=kname, kernel_form=kform, form_ms=form_ms, path=path, rel_err=rel(y_op, ref), dense_rel_err=rel(ffn_dense(*a0), ref),
                kernel_rel_err=rel(y_k, ref), nnz_per_row=sum(nnz) / layers, union=union,
                union_frac=union / n, dense_GBps=dense_bytes / (dense_ms * 1e-3) / 1e9,
                twell_GBps=op_bytes / (twell_ms * 1e-3) / 1e9,
                kernel_GBps=dec_bytes / (kernel_ms * 1e-3) / 1e9 if kname == "decode" else float("nan"),
                layers=layers)


def load_policy(path: str) -> None:
    """Use fitted decode-rule constants for this run (benchmarks/tune_decode.py --policy-out)."""
    for name, value in json.load(open(path)).items():
        if not (name.startswith(("DEC_ROWS_", "DEC_TILES_", "DEC_LIST_", "DEC_PAIRS_"))
                or name in ("DENSE_FIXED_US", "DENSE_GBPS")) \
                or not hasattr(cuda_policy, name):
            raise ValueError(f"--policy: unknown constant {name!r}")
        setattr(cuda_policy, name, float(value))


def load_configs(path: str) -> None:
    """Use tuned decode configs for this run ({padded M: [cuda_decode.Config fields in order, the
    first 8 at least]}, benchmarks/tune_decode.py; keys "wide:<padded M>" set WIDE_CONFIGS)."""
    for mp, vals in json.load(open(path)).items():
        table = cuda_decode.WIDE_CONFIGS if mp.startswith("wide:") else cuda_decode.CONFIGS
        table[int(mp.removeprefix("wide:"))] = cuda_decode.Config(*vals)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, nargs="+", default=DECODE_M)
    ap.add_argument("--density", type=float, nargs="+", default=DECODE_D)
    ap.add_argument("--tail", type=float, default=0.0)
    ap.add_argument("--shapes", nargs="+", default=DECODE_S, help="KxN pairs, e.g. 2048x5632")
    ap.add_argument("--reps", type=int, default=60, help="do_bench rep (ms)")
    ap.add_argument("--rotate-mb", type=float, default=ROTATE_MB,
                    help="weight bytes one timed pass reads (sets the number of layers)")
    ap.add_argument("--configs", default=None, help="JSON of decode configs to use (tune_decode.py)")
    ap.add_argument("--policy", default=None, help="JSON of decode-rule constants to use (tune_decode.py)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<gpu>/ffn_decode.json)")
    args = ap.parse_args(argv)
    for m in args.M:
        if m < 1:
            raise ValueError(f"--M values must be >= 1, got {m}")
    for d in args.density:
        if not 0.0 < d <= 1.0:
            raise ValueError(f"--density values must be in (0, 1], got {d}")
    shapes = []
    for sh in args.shapes:
        try:
            k, n = (int(v) for v in sh.split("x"))
        except ValueError:
            raise ValueError(f"--shapes takes KxN pairs like 2048x5632, got {sh!r}") from None
        shapes.append((k, n))
    if args.configs:
        load_configs(args.configs)
    if args.policy:
        load_policy(args.policy)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    peak = peak_gbps(args.reps)
    print(f"{torch.cuda.get_device_name()}: peak copy bandwidth {peak:.0f} GB/s", flush=True)
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / gpu_name() / "ffn_decode.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    hdr = (f"{'M':>5} {'K':>5} {'N':>6} {'dens':>6} {'union%':>6} {'dense':>7} {'twell':>7} {'kernel':>7} "
           f"{'x_op':>5} {'x_krn':>5} {'dGB/s':>6} {'tGB/s':>6} {'%peak':>5} {'err':>8} {'d_err':>8} path")
    print(hdr, flush=True)
    for k, n in shapes:
        for d in args.density:
            layers = layers_for(k, n, k, True, args.rotate_mb)
            sets = weight_sets(max(args.M), k, n, d, args.tail, layers, seed=hash((k, n, d)) & 0xFFFF)
            for m in args.M:
                row = run_point(sets, m, d, args.reps, f"bench_decode/{k}/{n}/{d}")
                row.update(tail=args.tail, peak_GBps=peak, gpu=torch.cuda.get_device_name())
                rows.append(row)
                print(f"{m:>5} {k:>5} {n:>6} {d:>6} {100 * row['union_frac']:>6.1f} {row['dense_ms'] * 1e3:>6.1f}u "
                      f"{row['twell_ms'] * 1e3:>6.1f}u {row['kernel_ms'] * 1e3:>6.1f}u "
                      f"{row['dense_ms'] / row['twell_ms']:>5.2f} {row['dense_ms'] / row['kernel_ms']:>5.2f} "
                      f"{row['dense_GBps']:>6.0f} {row['twell_GBps']:>6.0f} {100 * row['twell_GBps'] / peak:>4.0f}% "
                      f"{row['rel_err']:>8.1e} {row['dense_rel_err']:>8.1e} {row['path']}"
                      + ("  ERR>2x" if row["rel_err"] > 2 * row["dense_rel_err"] else "")
                      + "".join(f" {f} {t * 1e3:.1f}u" for f, t in row["form_ms"].items()), flush=True)
                out.write_text(json.dumps(rows, indent=1))     # after every row: partial runs keep data
            del sets
            weight_cache.clear()
            torch.cuda.empty_cache()
    ratios = [r["dense_ms"] / r["twell_ms"] for r in rows]
    print(f"wrote {out} ({len(rows)} rows); twell vs dense: min {min(ratios):.2f}x, max {max(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
