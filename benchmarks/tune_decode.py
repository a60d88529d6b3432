"""Tune the decode kernels' launch configs (kernels/cuda_decode.py CONFIGS), per padded M.

    python3 benchmarks/tune_decode.py --out /tmp/decode_configs.json

Greedy, in two phases per padded-M bucket: gate-kernel variants (BN, BK, warps, stages) with
the default down config, then down-kernel variants (CH, NS, BKO, warps) with the best gate
config. Score: mean over the bucket's M values and both shapes of time / default's time
(CUDA graph over several layers' weights, as bench_decode.py times them; d = 0.005 by default).
Writes the best config per bucket as JSON (bench_decode.py --configs reads it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import graph_ms, layers_for, weight_sets  # noqa: E402

from twell_compile.kernels import cuda_decode, weight_cache  # noqa: E402
from twell_compile.kernels.cuda_decode import Config  # noqa: E402

GATE = [(16, 256, 4, 4), (32, 256, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3), (64, 256, 8, 3)]
DOWN = [(128, 256, 64, 4), (64, 256, 64, 4), (128, 512, 128, 4), (64, 128, 32, 4), (128, 1024, 64, 4)]
BUCKETS = {16: [1, 16], 32: [32], 64: [64]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["2048x5632", "4096x11008"])
    ap.add_argument("--density", type=float, nargs="+", default=[0.005])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rotate-mb", type=float, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = []   # (weight sets, M)
    for sh in args.shapes:
        k, n = (int(v) for v in sh.split("x"))
        for d in args.density:
            sets = weight_sets(64, k, n, d, 0.0, layers_for(k, n, k, True, args.rotate_mb), seed=7)
            cases.append((f"{sh}/{d}", sets))

    def time_cfg(cfg: Config, m: int) -> list[float]:
        out = []
        for _, sets in cases:
            a = [(p["x"][:m].contiguous(), p["w_gate"], None, p["w_up"], None, p["w_down"], None) for p in sets]
            out.append(graph_ms(lambda: [cuda_decode.decode_forward(*x, cfg=cfg) for x in a], args.reps) / len(sets))
        return out

    best = {}
    for mp, ms in BUCKETS.items():
        base = cuda_decode.CONFIGS[mp]
        ref = {m: time_cfg(base, m) for m in ms}

        def score(cfg: Config) -> tuple[float, list]:
            ts = {m: time_cfg(cfg, m) for m in ms}
            r = [t / t0 for m in ms for t, t0 in zip(ts[m], ref[m])]
            return sum(r) / len(r), ts

        cur, cur_s = base, 1.0
        for gate in GATE:
            cfg = Config(*gate, *base[4:])
            if cfg == base:
                continue
            s, ts = score(cfg)
            print(f"M_P={mp} gate {gate} down {tuple(base[4:])}: {s:.3f} "
                  + " ".join(f"M{m}:" + ",".join(f"{t * 1e3:.1f}" for t in ts[m]) for m in ms), flush=True)
            if s < cur_s:
                cur, cur_s = cfg, s
        for down in DOWN:
            cfg = Config(*cur[:4], *down)
            if cfg == cur:
                continue
            s, ts = score(cfg)
            print(f"M_P={mp} gate {tuple(cur[:4])} down {down}: {s:.3f} "
                  + " ".join(f"M{m}:" + ",".join(f"{t * 1e3:.1f}" for t in ts[m]) for m in ms), flush=True)
            if s < cur_s:
                cur, cur_s = cfg, s
        best[mp] = list(cur)
        if args.out:   # after every bucket: a cut-short run keeps what it found
            Path(args.out).write_text(json.dumps({str(k): v for k, v in best.items()}, indent=1))
        print(f"best M_P={mp}: {tuple(cur)} ({cur_s:.3f} of default {tuple(base)}); default us: "
              + " ".join(f"M{m}:" + ",".join(f"{t * 1e3:.1f}" for t in ref[m]) for m in ms), flush=True)
    for mp in cuda_decode.CONFIGS:
        best.setdefault(mp, list(cuda_decode.CONFIGS[mp]))
    if args.out:
        Path(args.out).write_text(json.dumps({str(k): v for k, v in best.items()}, indent=1))
    weight_cache.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
