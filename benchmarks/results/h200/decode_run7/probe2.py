"""Probe 2: list-form config sweep; gate-only (nothing active) configs."""
import sys, json, itertools
from pathlib import Path
sys.path.insert(0, "benchmarks")
import torch
from bench_decode import graph_ms, weight_sets, layers_for
from twell_compile.kernels import cuda_decode, weight_cache
from twell_compile.reference import ffn_dense
import torch.nn.functional as F
torch.backends.cuda.matmul.allow_tf32 = False
reps = 30
res = []
def emit(r):
    print(json.dumps(r), flush=True); res.append(r)
for k, n in [(2048, 5632), (4096, 11008)]:
    sets = weight_sets(64, k, n, 0.005, 0.0, layers_for(k, n, k, True, 256), seed=11)
    quiet = [p["w_gate"].clone() for p in sets]
    for q in quiet:
        q[:, 0] = -1e4
    for m in ((1, 16) if k == 2048 else (16,)):
        a = [(p["x"][:m].contiguous(), q, None, p["w_up"], None, p["w_down"], None) for p, q in zip(sets, quiet)]
        base = cuda_decode.CONFIGS[16]._replace(bn=32)
        t_cub = graph_ms(lambda: [F.linear(x[0], x[1]) for x in a], reps) / len(a) * 1e3
        r = dict(kind="gate_only", M=m, K=k, cublas=round(t_cub, 2))
        for bn, bk, w, s in [(32, 256, 4, 3), (32, 256, 4, 4), (32, 128, 4, 4), (32, 128, 4, 6), (64, 128, 4, 3),
                             (64, 256, 8, 3), (16, 256, 4, 3), (16, 512, 4, 3), (32, 512, 4, 2), (64, 64, 4, 6),
                             (128, 128, 8, 3), (32, 256, 2, 3), (16, 256, 2, 4)]:
            cfg = base._replace(bn=bn, bk=bk, warps=w, stages=s)
            try:
                t = graph_ms(lambda: [cuda_decode.decode_forward(*x, cfg=cfg, form="list") for x in a], reps) / len(a) * 1e3
            except Exception as e:
                t = repr(e)[:80]
            r[f"{bn}/{bk}/{w}/{s}"] = t if isinstance(t, str) else round(t, 2)
        emit(r)
    for d in (0.005, 0.02):
        if d != 0.005:
            sets = weight_sets(64, k, n, d, 0.0, layers_for(k, n, k, True, 256), seed=11)
        for m in ((4, 8, 16, 32, 64) if k == 2048 else (16, 64)):
            if d == 0.02 and m not in (4, 16):
                continue
            a = [(p["x"][:m].contiguous(), p["w_gate"], None, p["w_up"], None, p["w_down"], None) for p in sets]
            ref = ffn_dense(*(None if t is None else t.double() for t in a[0]))
            derr = float((ffn_dense(*a[0]).double() - ref).norm() / ref.norm())
            r = dict(kind="list", M=m, K=k, d=d, dense=round(graph_ms(lambda: [ffn_dense(*x) for x in a], reps) / len(a) * 1e3, 2))
            base = cuda_decode.CONFIGS[cuda_decode.m_pad(m)]._replace(bn=32)
            for bo, le, gw, pb in itertools.product((64, 128), (32, 64, 128), (4, 8), (4, 8)):
                if pb == 8 and (bo, le, gw) not in ((64, 64, 4), (128, 64, 4), (64, 32, 4)):
                    continue
                cfg = base._replace(bo=bo, le=le, gwarps=gw, pb=pb)
                try:
                    y = cuda_decode.decode_forward(*a[0], cfg=cfg, form="list").y
                    err = float((y.double() - ref).norm() / ref.norm())
                    t = graph_ms(lambda: [cuda_decode.decode_forward(*x, cfg=cfg, form="list") for x in a], reps) / len(a) * 1e3
                    r[f"{bo}/{le}/{gw}/{pb}"] = round(t, 2) if err <= 2 * derr + 1e-6 else f"ERR {err:.2e}"
                except Exception as e:
                    r[f"{bo}/{le}/{gw}/{pb}"] = repr(e)[:80]
            emit(r)
    del sets
    weight_cache.clear()
    torch.cuda.empty_cache()
Path(sys.argv[1]).write_text(json.dumps(res, indent=1))
