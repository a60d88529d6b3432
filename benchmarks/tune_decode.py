"""Tune the decode path on the device: launch configs per padded M (kernels/cuda_decode.py
CONFIGS) and the decode rule's cost model (kernels/cuda_policy.py DEC_* / DENSE_* constants).

    python3 benchmarks/tune_decode.py --out /tmp/decode_configs.json --policy-out /tmp/decode_policy.json

1. Configs: every variant in VARIANTS is timed for each padded-M bucket at d = 0.005 (M values
   of the bucket x both shapes; CUDA graph over several layers' weights, as bench_decode.py
   times them); the best mean time ratio to the current default wins. This tunes the rows and
   tiles fields (the first 8 of cuda_decode.Config, set in CONFIGS and WIDE_CONFIGS alike); the
   list/pairs fields per width came from results/h200/session9/sweep_pairs.py.
2. Cost model: dense (eager's calls) and the decode kernels (best configs) at d in {0.005,
   0.05, 0.2} x M in {1, 16, 64} x both shapes, fitted by ``fit_policy`` (dense: fixed + bytes /
   rate; decode: fixed + W_gate bytes / rate + a cost per list entry). The shipped constants
   come from the 56-point bench grid instead: ``--fit-from results/h200/ffn_decode.json``.
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
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import graph_ms, layers_for, weight_sets  # noqa: E402

from twell_compile.kernels import cuda_decode, cuda_policy, weight_cache  # noqa: E402
from twell_compile.kernels.cuda_decode import Config  # noqa: E402
from twell_compile.reference import ffn_dense  # noqa: E402

# cuda_decode.Config fields: (bn, bk, bku, bko, vec_m, finish_max, warps, stages)
ROWS = [(32, 128, 256, 256, 4, 0, 4, 3), (32, 128, 256, 256, 4, 8192, 4, 3), (32, 128, 256, 256, 2, 0, 4, 3),
        (32, 128, 256, 256, 1, 0, 4, 3), (32, 128, 256, 256, 4, 0, 8, 3), (16, 128, 256, 256, 4, 0, 4, 3),
        (64, 128, 256, 256, 4, 0, 4, 3), (32, 256, 256, 256, 4, 0, 4, 3), (32, 64, 256, 256, 4, 0, 4, 5),
        (16, 128, 256, 256, 4, 0, 8, 3), (32, 128, 256, 256, 16, 0, 8, 3), (32, 128, 256, 256, 8, 0, 8, 3)]
TILES = [(32, 128, 256, 256, 0, 0, 4, 3), (64, 128, 256, 256, 0, 8192, 4, 3), (64, 128, 256, 256, 0, 0, 4, 3),
         (32, 128, 512, 512, 0, 0, 8, 3), (64, 128, 512, 256, 0, 0, 8, 3), (32, 128, 256, 256, 0, 8192, 4, 3)]
VARIANTS = {16: ROWS + TILES, 32: TILES, 64: TILES}
BUCKETS = {16: [1, 4, 16], 32: [32], 64: [64]}


def _lstsq(rows: list[list[float]], ts: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0 (a cost has no negative part): terms whose
    coefficient comes out negative are dropped (0) and the rest refitted."""
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(ts, dtype=torch.float64)
    keep = list(range(a.shape[1]))
    while True:
        sol = torch.linalg.lstsq(a[:, keep], b.unsqueeze(1)).solution.squeeze(1)
        neg = [j for j, v in zip(keep, sol.tolist()) if v < 0]
        if not neg or len(keep) == 1:
            out = [0.0] * a.shape[1]
            for j, v in zip(keep, sol.tolist()):
                out[j] = max(v, 0.0)
            return out
        keep.remove(min(neg, key=lambda j: sol[keep.index(j)].item()))


# Each form is fitted by least relative error (the rule compares forms by ratio): an absolute
# fit let K=4096's larger times steer the small-M forms (M=2 K=2048 took rows at 1.16x the
# pairs form's time, session 14 run 5's grid). Tiles' per-row cost is its atomics (R x K_out per
# active block): a per-row term over K + K_out missed N's share (K=4096 M=16 d=0.02 ran 0.96x of
# dense, run 6).


def fit_policy(points: list[dict], near: float = 1.6) -> dict[str, float]:
    """The decode rule's constants (kernels/cuda_policy.py) from measured points, each a dict
    with M, K, N, K_out, union (neurons active in some row), density, dense_us and forms
    ({form: decode us}, each form forced), each form fitted to its points within ``near`` x of
    dense (where the rule's decisions are made). Dense: fixed + bytes(3 weights) / rate; each
    decode form: its terms (cuda_policy.decode_terms, with u = union / N measured) times its
    constants (cuda_policy.DECODE_CONSTANTS). A form with fewer points than constants + 1 keeps
    its constants."""
    dense = _lstsq([[1.0, 2e-6 * p["N"] * 3 * p["K"]] for p in points], [p["dense_us"] for p in points])
    out = {"DENSE_FIXED_US": round(dense[0], 2), "DENSE_GBPS": round(1e3 / dense[1], 0)}
    names = cuda_policy.DECODE_CONSTANTS
    feats: dict[str, tuple[list, list]] = {}
    for form in cuda_decode.FORMS:
        for limit in (near, float("inf")):   # a form never near dense (list: its deterministic
            a, t = [], []                     # use) is fitted on all its points
            for p in points:
                us = p["forms"].get(form)
                if us is None or us > limit * p["dense_us"]:
                    continue
                a.append(cuda_policy.decode_terms(p["density"], p["union"] / p["N"], p["M"], p["K"], p["N"],
                                                  p.get("K_out", p["K"]))[form])
                t.append(us)
            if len(a) > len(names[form]):
                break
        feats[form] = (a, t)
    for form, (a, t) in feats.items():
        if len(a) <= len(names[form]):
            continue
        sol = _lstsq([[v / ti for v in row] for row, ti in zip(a, t)], [1.0] * len(t))   # relative error
        for i, (name, v) in enumerate(zip(names[form], sol)):
            out[name] = (round(1e3 / v, 0) if v > 0 else float("inf")) if i == 1 else round(v, 2 if i == 0 else 4)
    if len(out) == 2:
        raise SystemExit(f"too few decode points within {near}x of dense: nothing to fit")
    return out


def fit_from_bench(path: str) -> dict[str, float]:
    """fit_policy on a bench_decode.py JSON (its form_ms column: each decode form forced)."""
    rows = json.loads(Path(path).read_text())
    return fit_policy([dict(M=r["M"], K=r["K"], N=r["N"], union=r["union"], density=r["nnz_per_row"] / r["N"],
                            dense_us=r["dense_ms"] * 1e3, forms={f: t * 1e3 for f, t in r["form_ms"].items()})
                       for r in rows if r.get("kernel") == "decode"])


def parts(sets, shapes, reps) -> None:
    """Where the time goes at d = 0.005 (tuned configs), per layer, CUDA graphs over all layers:
    cuBLAS gate GEMV alone, the decode path with nothing active (gate + launch + finish: W_gate's
    column 0 pushed to -1e4 on copies of the weights), the decode path, dense; and an empty
    Triton launch (the graph's per-launch cost)."""
    import triton
    import triton.language as tl

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
    ap.add_argument("--out", default=None, help="JSON of the best config per padded M")
    ap.add_argument("--policy-out", default=None, help="JSON of the fitted cost-model constants")
    ap.add_argument("--fit-from", default=None, metavar="BENCH_JSON",
                    help="no GPU: fit the cost model to a bench_ffn.py --decode JSON and print it")
    args = ap.parse_args(argv)
    if args.fit_from:
        pol = fit_from_bench(args.fit_from)
        print("cost model fit:", pol, flush=True)
        if args.policy_out:
            Path(args.policy_out).write_text(json.dumps(pol, indent=1))
        return 0
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
        print(f"M_P={mp} {tuple(cfg)}: {ratio:.3f} of default; us " + " ".join(f"{t * 1e3:.1f}" for t in ts),
              flush=True)
        return ratio, ts

    for mp in args.buckets:
        ms = BUCKETS[mp]
        base = cuda_decode.CONFIGS[mp]
        _, base_times = evaluate(mp, ms, base, None)
        if base_times is None:
            raise SystemExit(f"the default decode config for M_P={mp} is not exact")
        win, win_ratio = base, 1.0
        for v in VARIANTS[mp]:
            cfg = Config(*v)
            if cfg == base:
                continue
            ratio, _ = evaluate(mp, ms, cfg, base_times)
            if ratio is not None and ratio < win_ratio:
                win, win_ratio = cfg, ratio
        cuda_decode.CONFIGS[mp] = win
        # the rows/tiles fields (the first 8) hold for both widths; the list/pairs fields of
        # WIDE_CONFIGS stay (session 9 sweep: results/h200/session9/sweep_pairs.py)
        cuda_decode.WIDE_CONFIGS[mp] = cuda_decode.WIDE_CONFIGS[mp]._replace(**dict(zip(Config._fields[:8], win[:8])))
        print(f"best M_P={mp}: {tuple(win)} ({win_ratio:.3f} of default)", flush=True)
        if args.out:   # after every bucket: a cut-short run keeps what it found
            tables = {str(k): list(v) for k, v in cuda_decode.CONFIGS.items()}
            tables.update({f"wide:{k}": list(v) for k, v in cuda_decode.WIDE_CONFIGS.items()})
            Path(args.out).write_text(json.dumps(tables, indent=1))
    parts(sets, shapes, args.reps)

    points = []
    for (k, n, d), ws in sets.items():
        for m in (1, 16, 64):
            a = args_of(ws, m)
            td = graph_ms(lambda: [ffn_dense(*x) for x in a], args.reps) / len(ws) * 1e3
            union = sum(float((F.linear(x[0], x[1]) > 0).any(0).sum()) for x in a) / len(a)
            nnz = sum(float((F.linear(x[0], x[1]) > 0).sum()) for x in a) / len(a) / m
            forms = {f: graph_ms(lambda: [cuda_decode.decode_forward(*x, form=f) for x in a], args.reps) / len(a) * 1e3
                     for f in cuda_decode.FORMS if f != "rows" or m <= cuda_decode.config_for(m, k).vec_m}
            tk = min(forms.values())
            points.append(dict(M=m, K=k, N=n, union=union, density=nnz / n, dense_us=td, forms=forms))
            print(f"K={k} N={n} d={d} M={m}: dense {td:.1f} us, decode {tk:.1f} us "
                  f"(union {100 * union / n:.1f}%): {td / tk:.2f}x", flush=True)
    pol = fit_policy(points)
    print("cost model fit:", pol, flush=True)
    if args.policy_out:
        Path(args.policy_out).write_text(json.dumps(pol, indent=1))
    weight_cache.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
