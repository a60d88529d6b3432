"""Session 14 sweep 2: run 1 found 2 pairs per trip (pb) at 16 neurons per program faster at
M=16 (18.97 us vs the shipped 19.51); here pb, the K chunk of the pair gathers (kc), the W_d^T
chunk requested with them (koc), lbn and stages around it, each config timed ``REPS`` times
interleaved with the others (median), K=2048 N=5632 d=0.005. Every config is first checked
against fp64 under the 2x rule (session9/probe_io.config_us).

    python3 benchmarks/results/h200/session14/sweep_pairs_trip.py OUT.json [trip|gate|final] [M ...]

Family "gate" (run 3): at lbn 16, pb 2, the tl.dot gate's K step (lbk), stages and warps.
"""
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "session9"))
from probe_io import config_us, emit  # noqa: E402  (puts the repo root and benchmarks/ on sys.path)

REPS = int(__import__('os').environ.get('REPS', 3))
FAMILIES = {
    "trip": {f"lbn{b}/pb{pb}/kc{kc}/koc{koc}/s{s}": dict(lbn=b, pb=pb, kc=kc, koc=koc, lstages=s)
             for b, pb, kc, koc, s in itertools.product((16, 32), (1, 2, 4), (1024, 2048), (1024, 2048), (4, 5))},
    "gate": {f"lbn16/pb2/lbk{k}/s{s}/w{w}": dict(lbn=16, pb=2, lbk=k, lstages=s, warps=w)
             for k, s, w in itertools.product((64, 128, 256), (3, 4, 5, 6), (2, 4, 8))},
    # run 4: candidates at every M <= 16 (all share one config), 2 warps (lwarps: the pairs
    # kernel's own warps, new this session) and its neighbours
    "final": {"lbn16/pb2/s5/w2": dict(lbn=16, pb=2, lwarps=2),
              "lbn16/pb2/s6/w2": dict(lbn=16, pb=2, lstages=6, lwarps=2),
              "lbn16/pb2/s5/w1": dict(lbn=16, pb=2, lwarps=1),
              "lbn32/pb2/s5/w2": dict(lbn=32, pb=2, lwarps=2),
              "lbn16/pb1/s5/w2": dict(lbn=16, pb=1, lwarps=2),
              "lbn16/pb4/s5/w2": dict(lbn=16, pb=4, lwarps=2),
              "lbn16/pb2/kc1024/s5/w2": dict(lbn=16, pb=2, kc=1024, lwarps=2),
              "lbn16/pb2/lbk64/s6/w2": dict(lbn=16, pb=2, lbk=64, lstages=6, lwarps=2),
              "lbn16/pb2/s5/w4": dict(lbn=16, pb=2)},
}


def main():
    import torch

    from bench_decode import graph_ms, layers_for, weight_sets
    from twell_compile.kernels import cuda_decode
    from twell_compile.reference import ffn_dense

    torch.manual_seed(0)
    k, n, d = 2048, 5632, 0.005
    sets = weight_sets(64, k, n, d, 0.0, layers_for(k, n, k, True, 256), seed=11)
    args = sys.argv[2:]
    cfgs = FAMILIES[args.pop(0) if args and args[0] in FAMILIES else "trip"]
    for m in tuple(int(v) for v in args) or (16, 8, 4, 2):
        a = [(p["x"][:m].contiguous(), p["w_gate"], None, p["w_up"], None, p["w_down"], None) for p in sets]
        base = cuda_decode.config_for(m, k)
        r = dict(K=k, N=n, M=m, density=d, form="pairs", shipped=base._asdict(), t={})
        for rep in range(REPS):
            r.setdefault("dense_us", []).append(round(graph_ms(lambda: [ffn_dense(*x) for x in a], 40) / len(a) * 1e3, 2))
            for key, f in {"shipped": {}, **cfgs}.items():
                r["t"].setdefault(key, []).append(config_us(a, base._replace(**f), "pairs"))
        r["median"] = {kk: sorted(v)[len(v) // 2] if all(isinstance(x, float) for x in v) else v
                       for kk, v in r["t"].items()}
        r["best"] = sorted((v, kk) for kk, v in r["median"].items() if isinstance(v, float))[:8]
        emit(r)
        print("BEST", m, "dense", r["dense_us"], "shipped", r["median"]["shipped"], r["best"][:6], flush=True)


main()
