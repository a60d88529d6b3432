"""Session 9 sweep (H200): the decode list form against the new pairs form (per active pair,
atomics into the accumulator) over their launch configs, d=0.005 (and 0.02 at M=16), both
shapes, CUDA graph over several layers (as bench_decode). Prints JSON lines, writes argv[1].

    python3 benchmarks/results/h200/session9/sweep_pairs.py OUT.json [--quick]
"""
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_io import config_us, emit  # noqa: E402  (puts the repo root and benchmarks/ on sys.path)
import torch  # noqa: E402

from bench_decode import graph_ms, layers_for, weight_sets  # noqa: E402
from twell_compile.kernels import cuda_decode  # noqa: E402
from twell_compile.reference import ffn_dense  # noqa: E402


def variants(mp):
    """36 + 8: lbn x gate (K step, stages) x udot (x pb for pairs) at 4 warps, K_out whole per
    step; then warps 8 and K_out steps of 1024 around the shipped lbn 32."""
    base = cuda_decode.CONFIGS[mp]
    vs = []
    for form, lbn, (lbk, lst), udot, pb in itertools.product(
            ("list", "pairs"), (16, 32, 64), ((256, 3), (128, 5)), (False, True), (4, 8)):
        if form == "list" and pb != 4:
            continue
        vs.append((form, base._replace(lbn=lbn, lbk=lbk, lstages=lst, warps=4, udot=udot, pb=pb, koc=2048)))
    for warps, udot, pb, koc in ((8, False, 4, 2048), (8, True, 4, 2048), (8, False, 8, 2048), (8, True, 8, 2048),
                                 (4, False, 4, 1024), (4, True, 4, 1024), (4, False, 8, 1024), (4, True, 8, 1024)):
        vs.append(("pairs", base._replace(lbn=32, lbk=256, lstages=3, warps=warps, udot=udot, pb=pb, koc=koc)))
    return vs


torch.manual_seed(0)
shapes = [(2048, 5632), (4096, 11008)]
points = [(16, 0.005), (8, 0.005), (32, 0.005), (4, 0.005), (16, 0.02)]
if "--quick" in sys.argv:
    points = [(16, 0.005)]
for k, n in shapes:
    for d in sorted({p[1] for p in points}):
        sets = weight_sets(64, k, n, d, 0.0, layers_for(k, n, k, True, 256), seed=11)
        for m, dd in points:
            if dd != d:
                continue
            a = [(p["x"][:m].contiguous(), p["w_gate"], None, p["w_up"], None, p["w_down"], None) for p in sets]
            mp = cuda_decode.m_pad(m)
            dense = graph_ms(lambda: [ffn_dense(*x) for x in a], 40) / len(a) * 1e3
            r = dict(K=k, N=n, M=m, density=d, dense_us=round(dense, 2), t={})
            shipped = {}
            for f in ("list", "tiles") + (("rows",) if m <= cuda_decode.CONFIGS[mp].vec_m else ()):
                shipped[f] = round(graph_ms(lambda: [cuda_decode.decode_forward(*x, form=f) for x in a], 40)
                                   / len(a) * 1e3, 2)
            r["shipped"] = shipped
            for form, cfg in variants(mp):
                key = f"{form}/lbn{cfg.lbn}/lbk{cfg.lbk}/st{cfg.lstages}/w{cfg.warps}/u{int(cfg.udot)}/pb{cfg.pb}/koc{cfg.koc}"
                r["t"][key] = config_us(a, cfg, form)
            best = sorted(((v, kk) for kk, v in r["t"].items() if isinstance(v, float)))[:8]
            r["best"] = best
            emit(r)
            print("BEST", k, m, d, "dense", r["dense_us"], "shipped", shipped, best[:4], flush=True)
