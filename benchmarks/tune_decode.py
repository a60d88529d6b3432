"""Tune the decode path on the device: launch configs per padded M (kernels/cuda_decode.py
CONFIGS) and the decode rule's cost model (kernels/cuda_policy.py DEC_* / DENSE_* constants).

    python3 benchmarks/tune_decode.py --out /tmp/decode_configs.json --policy-out /tmp/decode_policy.json

1. Configs: every variant in VARIANTS is timed for each padded-M bucket at d = 0.005 (M values
   of the bucket x both shapes; CUDA graph over several layers' weights, as bench_decode.py
   times them); the best mean time ratio to the current default wins.
2. Cost model: dense (eager's calls) and the decode kernels (best configs) at d in {0.005,
   0.05, 0.2} x M in {1, 16, 64} x both shapes; t = fixed + bytes / rate fitted by least squares
   for each (bytes: all three weights for dense; W_gate plus the measured union's W_up and
   W_down^T rows for decode).
bench_decode.py --configs / --policy read the two JSON files, so one device run can tune and
then measure with the tuned values; the shipped constants are copied from them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import graph_ms, layers_for, weight_sets  # noqa: E402

from twell_compile.kernels import cuda_decode, weight_cache  # noqa: E402
from twell_compile.kernels.cuda_decode import Config  # noqa: E402
from twell_compile.reference import ffn_dense  # noqa: E402

# (ch, bk, bko, warps, stages, ksplit)
VARIANTS = [(32, 256, 128, 4, 3, 1), (64, 128, 128, 4, 3, 1), (128, 64, 128, 4, 3, 1),
            (32, 256, 128, 4, 3, 2), (64, 128, 128, 4, 3, 2), (64, 128, 256, 8, 3, 1)]
BUCKETS = {16: [1, 16], 32: [32], 64: [64]}


def _fit(xs: list[float], ts: list[float]) -> tuple[float, float]:
    """t = fixed + x / rate by least squares; (fixed us >= 0, rate GB/s)."""
    a = torch.tensor([[1.0, x] for x in xs], dtype=torch.float64)
    b = torch.tensor(ts, dtype=torch.float64)
    sol = torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1)
    fixed, slope = float(sol[0]), float(sol[1])
    if fixed < 0 or slope <= 0:             # degenerate: pure rate through the origin
        fixed, slope = 0.0, float((a[:, 1] * b).sum() / (a[:, 1] ** 2).sum())
    return fixed, 1.0 / slope


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["2048x5632", "4096x11008"])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rotate-mb", type=float, default=256)
    ap.add_argument("--out", default=None, help="JSON of the best config per padded M")
    ap.add_argument("--policy-out", default=None, help="JSON of the fitted cost-model constants")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes]
    sets = {}
    for k, n in shapes:
        for d in (0.005, 0.05, 0.2):
            sets[(k, n, d)] = weight_sets(64, k, n, d, 0.0, layers_for(k, n, k, True, args.rotate_mb), seed=7)

    def args_of(ws, m):
        return [(p["x"][:m].contiguous(), p["w_gate"], None, p["w_up"], None, p["w_down"], None) for p in ws]

    def t_decode(ws, m, cfg):
        a = args_of(ws, m)
        return graph_ms(lambda: [cuda_decode.decode_forward(*x, cfg=cfg) for x in a], args.reps) / len(ws)

    best = {}
    for mp, ms in BUCKETS.items():
        base = cuda_decode.CONFIGS[mp]
        cands = [base] + [Config(*v) for v in VARIANTS if Config(*v) != base]
        times = {}
        for cfg in cands:
            times[cfg] = [t_decode(sets[(k, n, 0.005)], m, cfg) for m in ms for k, n in shapes]
            ratio = sum(t / t0 for t, t0 in zip(times[cfg], times[base])) / len(times[base])
            print(f"M_P={mp} {tuple(cfg)}: {ratio:.3f} of default; us "
                  + " ".join(f"{t * 1e3:.1f}" for t in times[cfg]), flush=True)
        win = min(cands, key=lambda c: sum(t / t0 for t, t0 in zip(times[c], times[base])))
        best[mp] = win
        cuda_decode.CONFIGS[mp] = win
        print(f"best M_P={mp}: {tuple(win)}", flush=True)
        if args.out:   # after every bucket: a cut-short run keeps what it found
            Path(args.out).write_text(json.dumps({str(k): list(v) for k, v in cuda_decode.CONFIGS.items()}, indent=1))

    dense_x, dense_t, dec_x, dec_t = [], [], [], []
    for (k, n, d), ws in sets.items():
        for m in (1, 16, 64):
            a = args_of(ws, m)
            td = graph_ms(lambda: [ffn_dense(*x) for x in a], args.reps) / len(ws) * 1e3
            tk = t_decode(ws, m, None) * 1e3
            union = sum(float((F.linear(x[0], x[1]) > 0).any(0).sum()) for x in a) / len(a)
            dense_x.append(2e-6 * n * (2 * k + k) * 1e3)          # MB x 1e3: t us = fixed + x / GB/s
            dense_t.append(td)
            dec_x.append(2e-6 * (n * k + union * (k + k)) * 1e3)
            dec_t.append(tk)
            print(f"K={k} N={n} d={d} M={m}: dense {td:.1f} us, decode {tk:.1f} us "
                  f"(union {100 * union / n:.1f}%): {td / tk:.2f}x", flush=True)
    dfix, drate = _fit(dense_x, dense_t)
    kfix, krate = _fit(dec_x, dec_t)
    pol = {"DENSE_FIXED_US": round(dfix, 2), "DENSE_GBPS": round(drate, 0),
           "DEC_FIXED_US": round(kfix, 2), "DEC_GBPS": round(krate, 0)}
    print("cost model fit:", pol, flush=True)
    if args.policy_out:
        Path(args.policy_out).write_text(json.dumps(pol, indent=1))
    weight_cache.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
