"""Session 8 probe 3 (H200): list form with the tl.dot up projection (udot) vs per-pair gathers,
then the L2 row-gather ceiling and host time per call by entry point (probe.py's (c), (d))."""
import sys, json, itertools
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "benchmarks/results/h200/session8")
from probe_kernels import *  # noqa: F401,F403 (Triton kernels need a file)
from bench_decode import graph_ms as gms, weight_sets, layers_for
from twell_compile.kernels import cuda_decode, weight_cache
from twell_compile.reference import ffn_dense
dev = "cuda"
K, N = 2048, 5632
for d in (0.005, 0.02, 0.05):
    sets = weight_sets(64, K, N, d, 0.0, layers_for(K, N, K, True, 256), seed=11)
    L = len(sets)
    for m in (1, 2, 4, 8, 16, 32, 64):
        if d > 0.005 and m not in (1, 4, 16):
            continue
        xs = [p["x"][:m].contiguous() for p in sets]
        a = [(x, p["w_gate"], None, p["w_up"], None, p["w_down"], None) for x, p in zip(xs, sets)]
        ref = ffn_dense(*(None if t is None else t.double() for t in a[0]))
        derr = float((ffn_dense(*a[0]).double() - ref).norm() / ref.norm())
        r = dict(kind="udot", M=m, d=d, dense=round(gms(lambda: [ffn_dense(*x) for x in a], 40) / L * 1e3, 2))
        base = cuda_decode.CONFIGS[cuda_decode.m_pad(m)]
        r["list_now"] = round(gms(lambda: [cuda_decode.decode_forward(*x, form="list") for x in a], 40) / L * 1e3, 2)
        if m <= base.vec_m:
            r["rows_now"] = round(gms(lambda: [cuda_decode.decode_forward(*x, form="rows") for x in a], 40) / L * 1e3, 2)
        r["tiles_now"] = round(gms(lambda: [cuda_decode.decode_forward(*x, form="tiles") for x in a], 40) / L * 1e3, 2)
        grid = itertools.product((16, 32, 64), (128, 256), (128, 256), (3, 5), (32, 64), (4,))
        if not (m == 16 and d == 0.005):
            grid = [(32, 128, 256, 3, 32, 4), (32, 256, 256, 3, 64, 4), (32, 128, 128, 5, 32, 4), (16, 128, 256, 5, 32, 4), (64, 128, 128, 5, 32, 4)]
        for lbn, bk, bku, st, le, w in grid:
            cfg = base._replace(lbn=lbn, bk=bk, bku=bku, stages=st, le=le, warps=w, udot=True)
            try:
                y = cuda_decode.decode_forward(*a[0], cfg=cfg, form="list").y
                err = float((y.double() - ref).norm() / ref.norm())
                t = gms(lambda: [cuda_decode.decode_forward(*x, cfg=cfg, form="list") for x in a], 40) / L * 1e3
                r[f"{lbn}/{bk}/{bku}/{st}/{le}"] = round(t, 2) if err <= 2 * derr else f"ERR {err:.1e} vs {derr:.1e}"
            except Exception as e:
                r[f"{lbn}/{bk}/{bku}/{st}/{le}"] = repr(e)[:60]
        emit(r)
    del sets
    weight_cache.clear()
    torch.cuda.empty_cache()
exec(open("benchmarks/results/h200/session8/probe3_tail.py").read())
