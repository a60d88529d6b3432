"""Session 11 sweep (H200): the decode pairs form's launch configs with programmatic dependent
launch on (the default since this session), K=2048 N=5632 d=0.005, M=8 and 16, CUDA graph over
several layers (as bench_decode). Prints JSON lines, writes argv[1].

    python3 benchmarks/results/h200/session11/sweep_pdl.py OUT.json
"""
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "session9"))
from probe_io import emit  # noqa: E402  (puts the repo root and benchmarks/ on sys.path)
import torch  # noqa: E402
import triton  # noqa: E402

from bench_decode import graph_ms, layers_for, weight_sets  # noqa: E402
from twell_compile.kernels import cuda_decode  # noqa: E402
from twell_compile.reference import ffn_dense  # noqa: E402

torch.manual_seed(0)
k, n, d = 2048, 5632, 0.005
sets = weight_sets(64, k, n, d, 0.0, layers_for(k, n, k, True, 256), seed=11)
for m in (16, 8):
    a = [(p["x"][:m].contiguous(), p["w_gate"], None, p["w_up"], None, p["w_down"], None) for p in sets]
    base = cuda_decode.config_for(m, k)
    dense = graph_ms(lambda: [ffn_dense(*x) for x in a], 40) / len(a) * 1e3
    r = dict(K=k, N=n, M=m, density=d, pdl=cuda_decode.pdl_ok(a[0][0].device), dense_us=round(dense, 2), t={})
    for lbn, (lbk, lst), warps in itertools.product((32, 16, 64), ((128, 5), (128, 6), (128, 8), (256, 3), (256, 4), (64, 8)), (4, 8)):
        cfg = base._replace(lbn=lbn, lbk=lbk, lstages=lst, warps=warps)
        key = f"lbn{lbn}/lbk{lbk}/st{lst}/w{warps}"
        try:
            x = a[0]
            ref = ffn_dense(*(None if t is None else t.double() for t in x))
            y = cuda_decode.decode_forward(*x, cfg=cfg, form="pairs").y.double()
            err = float((y - ref).norm() / ref.norm())
            derr = float((ffn_dense(*x).double() - ref).norm() / ref.norm())
            if err > 2 * derr:
                r["t"][key] = f"ERR {err:.2e} vs {derr:.2e}"
                continue
            r["t"][key] = round(graph_ms(lambda: [cuda_decode.decode_forward(*x, cfg=cfg, form="pairs")
                                                  for x in a], 30) / len(a) * 1e3, 2)
        except triton.runtime.errors.OutOfResources as e:
            r["t"][key] = f"OOR {str(e)[:40]}"
    r["best"] = sorted(((v, kk) for kk, v in r["t"].items() if isinstance(v, float)))[:8]
    emit(r)
    print("BEST", m, "dense", r["dense_us"], r["best"][:5], flush=True)
