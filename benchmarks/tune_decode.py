"""Tune the decode path on the device: launch configs per padded M (the GPU record's
decode_configs, runtime/arch.py) and the decode rule's cost model (its decode_forms,
dense_fixed_us, dense_gbps).

    python3 benchmarks/tune_decode.py --out runs/decode_configs.json --policy-out runs/decode_policy.json

1. Configs: every variant in VARIANTS is timed for each padded-M bucket at d = 0.005 (M values
   of the bucket x both shapes; CUDA graph over several layers' weights, as bench_decode.py
   times them); the best mean time ratio to the record's config wins. This tunes the rows and
   tiles fields (the first 8 of arch.DecodeConfig, set in decode_configs and
   wide_decode_configs alike); the list/pairs fields per width stay the record's (tuned on the
   H200, 2026-11-22 to 2026-11-23: arch.py).
2. Cost model: dense (eager's calls) and each decode form forced (the winning configs, in
   place through arch.patched) at d in {0.005, 0.05, 0.2} x M in {1, 16, 64} x both shapes,
   fitted by fit_policy.fit_decode. The shipped constants come from the 56-point bench grid
   instead: ``python3 benchmarks/fit_policy.py --fit-decode benchmarks/results/h200/ffn_decode.json``.
bench_decode.py --configs / --policy read the two JSON files, so one device run can tune and
then measure with the tuned values; the record's values are copied from them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

if __package__ in (None, ""):                  # run as a file: python3 benchmarks/tune_decode.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_decode import graph_ms, layers_for, weight_sets  # noqa: E402
from benchmarks.fit_policy import fit_decode, policy_json, record_text  # noqa: E402

from twell_compile.reference import ffn_dense  # noqa: E402
from twell_compile.runtime import arch, cuda_decode, decode_state  # noqa: E402
from twell_compile.runtime.arch import DecodeConfig  # noqa: E402

# arch.DecodeConfig fields: (bn, bk, bku, bko, vec_m, finish_max, warps, stages)
ROWS = [(32, 128, 256, 256, 4, 0, 4, 3), (32, 128, 256, 256, 4, 8192, 4, 3), (32, 128, 256, 256, 2, 0, 4, 3),
        (32, 128, 256, 256, 1, 0, 4, 3), (32, 128, 256, 256, 4, 0, 8, 3), (16, 128, 256, 256, 4, 0, 4, 3),
        (64, 128, 256, 256, 4, 0, 4, 3), (32, 256, 256, 256, 4, 0, 4, 3), (32, 64, 256, 256, 4, 0, 4, 5),
        (16, 128, 256, 256, 4, 0, 8, 3), (32, 128, 256, 256, 16, 0, 8, 3), (32, 128, 256, 256, 8, 0, 8, 3)]
TILES = [(32, 128, 256, 256, 0, 0, 4, 3), (64, 128, 256, 256, 0, 8192, 4, 3), (64, 128, 256, 256, 0, 0, 4, 3),
         (32, 128, 512, 512, 0, 0, 8, 3), (64, 128, 512, 256, 0, 0, 8, 3), (32, 128, 256, 256, 0, 8192, 4, 3)]
VARIANTS = {16: ROWS + TILES, 32: TILES, 64: TILES}
BUCKETS = {16: [1, 4, 16], 32: [32], 64: [64]}


def configs_json(configs: dict[int, DecodeConfig], wide: dict[int, DecodeConfig]) -> dict[str, list]:
    """bench_decode.py --configs's format: {padded M: fields, "wide:<padded M>": fields}."""
    return {**{str(k): list(v) for k, v in configs.items()}, **{f"wide:{k}": list(v) for k, v in wide.items()}}


def parts(sets, shapes, reps) -> None:
    """Where the time goes at d = 0.005 (tuned configs), per layer, CUDA graphs over all layers:
    cuBLAS gate GEMV alone, the decode path with nothing active (gate + launch + finish: W_gate's
    column 0 pushed to -1e4 on copies of the weights), the decode path, dense; and an empty
    Triton launch (the graph's per-launch cost)."""
    @triton.jit
    def _empty(p):
        pass

    dummy = torch.empty(1, device="cuda")
    t_empty = graph_ms(lambda: [_empty[(132,)](dummy) for _ in range(8)], reps) / 8 * 1e3
    print(f"parts: empty Triton launch {t_empty:.2f} us each in a graph of 8", flush=True)
    for k, n in shapes:
        ws = sets[(k, n, 0.005)]
        quiet = []
        for p in ws:
            wg = p["w_gate"].clone()
            wg[:, 0] = -1e4
            quiet.append(wg)
        for m in (1, 16, 64):
            a = [(p["x"][:m].contiguous(), p["w_gate"], None, p["w_up"], None, p["w_down"], None) for p in ws]
            aq = [(x[0], wq) + x[2:] for x, wq in zip(a, quiet)]
            t_cublas = graph_ms(lambda: [F.linear(x[0], x[1]) for x in a], reps) / len(ws) * 1e3
            t_quiet = graph_ms(lambda: [cuda_decode.decode_forward(*x) for x in aq], reps) / len(ws) * 1e3
            t_dec = graph_ms(lambda: [cuda_decode.decode_forward(*x) for x in a], reps) / len(ws) * 1e3
            t_dense = graph_ms(lambda: [ffn_dense(*x) for x in a], reps) / len(ws) * 1e3
            print(f"parts K={k} N={n} M={m} d=0.005: cuBLAS gate {t_cublas:.1f} us, decode with nothing active "
                  f"{t_quiet:.1f} us ({2e-3 * n * k / t_quiet:.0f} GB/s of W_gate), decode {t_dec:.1f} us, "
                  f"dense {t_dense:.1f} us ({t_dense / t_dec:.2f}x)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["2048x5632", "4096x11008"])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rotate-mb", type=float, default=256)
    ap.add_argument("--buckets", type=int, nargs="+", default=list(BUCKETS), help="padded-M buckets to tune")
    ap.add_argument("--out", default=None, help="JSON of the best config per padded M (bench_decode.py --configs)")
    ap.add_argument("--policy-out", default=None,
                    help="JSON of the fitted cost-model fields (bench_decode.py --policy)")
    args = ap.parse_args(argv)
    for mp in args.buckets:
        if mp not in BUCKETS:
            raise ValueError(f"--buckets takes {sorted(BUCKETS)}, got {mp}")
    if not torch.cuda.is_available():
        raise SystemExit("tune_decode.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    record = arch.policy_for(torch.device("cuda"))
    configs, wide = dict(record.decode_configs), dict(record.wide_decode_configs)
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

    def wrong(ws, m, cfg):
        """'' if the config's output on layer 0 meets the 2x-of-eager error rule, else why not."""
        x = args_of(ws[:1], m)[0]
        ref = ffn_dense(*(None if t is None else t.double() for t in x))
        y = cuda_decode.decode_forward(*x, cfg=cfg).y.double()
        err = float((y - ref).norm() / ref.norm())
        derr = float((ffn_dense(*x).double() - ref).norm() / ref.norm())
        return "" if err <= 2 * derr + 1e-6 else f"rel. error {err:.2e} > 2 x eager's {derr:.2e} (M={m})"

    def evaluate(mp, ms, cfg, base_times):
        """Mean time ratio of cfg to base_times over the bucket's M x shapes (None: not exact)."""
        try:
            bad = [wrong(ws, m, cfg) for m in ms for ws in (sets[(k, n, 0.005)] for k, n in shapes)]
        except triton.runtime.errors.OutOfResources as e:     # e.g. shared memory: not a candidate
            print(f"M_P={mp} {tuple(cfg)}: REJECTED, {e}", flush=True)
            return None, None
        if any(bad):      # a config that is not exact never wins
            print(f"M_P={mp} {tuple(cfg)}: REJECTED, {[b for b in bad if b][0]}", flush=True)
            return None, None
        ts = [t_decode(sets[(k, n, 0.005)], m, cfg) for m in ms for k, n in shapes]
        ratio = 1.0 if base_times is None else sum(t / t0 for t, t0 in zip(ts, base_times)) / len(ts)
        print(f"M_P={mp} {tuple(cfg)}: {ratio:.3f} of the record's; us " + " ".join(f"{t * 1e3:.1f}" for t in ts),
              flush=True)
        return ratio, ts

    for mp in args.buckets:
        ms = BUCKETS[mp]
        base = configs[mp]
        _, base_times = evaluate(mp, ms, base, None)
        if base_times is None:
            raise SystemExit(f"the record's decode config for M_P={mp} is not exact")
        win, win_ratio = base, 1.0
        for v in VARIANTS[mp]:
            cfg = DecodeConfig(*v)
            if cfg == base:
                continue
            ratio, _ = evaluate(mp, ms, cfg, base_times)
            if ratio is not None and ratio < win_ratio:
                win, win_ratio = cfg, ratio
        configs[mp] = win
        # the rows/tiles fields (the first 8) hold for both widths; the list/pairs fields of the
        # wide configs stay the record's
        wide[mp] = wide[mp]._replace(**dict(zip(DecodeConfig._fields[:8], win[:8])))
        print(f"best M_P={mp}: {tuple(win)} ({win_ratio:.3f} of the record's)", flush=True)
        if args.out:   # after every bucket: a cut-short run keeps what it found
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(configs_json(configs, wide), indent=1) + "\n")
    with arch.patched(decode_configs=configs, wide_decode_configs=wide):
        parts(sets, shapes, args.reps)
        points = []
        for (k, n, d), ws in sets.items():
            for m in (1, 16, 64):
                a = args_of(ws, m)
                td = graph_ms(lambda: [ffn_dense(*x) for x in a], args.reps) / len(ws) * 1e3
                union = sum(float((F.linear(x[0], x[1]) > 0).any(0).sum()) for x in a) / len(a)
                nnz = sum(float((F.linear(x[0], x[1]) > 0).sum()) for x in a) / len(a) / m
                vec_m = arch.policy_for(torch.device("cuda")).decode_config(m, k).vec_m
                forms = {f: graph_ms(lambda: [cuda_decode.decode_forward(*x, form=f) for x in a], args.reps)
                         / len(a) * 1e3 for f in cuda_decode.FORMS if f != "rows" or m <= vec_m}
                tk = min(forms.values())
                points.append(dict(M=m, K=k, N=n, K_out=k, union=union, density=nnz / n, dense_us=td, forms=forms))
                print(f"K={k} N={n} d={d} M={m}: dense {td:.1f} us, decode {tk:.1f} us "
                      f"(union {100 * union / n:.1f}%): {td / tk:.2f}x", flush=True)
    fit = fit_decode(record, points)
    print("cost model fit:\n" + record_text(fit), flush=True)
    if args.policy_out:
        Path(args.policy_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.policy_out).write_text(policy_json(fit))
    decode_state.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
