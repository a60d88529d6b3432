"""Session 12 sweep, for the next device session (not run yet): the pairs form's up
projection, which probe_parts.py measured at 5.5 us of M=16's 19.6 (one memory round trip per
PB pairs; a program holds up to ~8 pairs at M=16, d=0.005, so two trips at PB=4). Pairs per
trip (pb), the K chunk of its gathers (kc), the W_d^T chunk requested with them (koc) and
warps, at K=2048 N=5632 d=0.005, M=8 and 16, CUDA graph over the rotated layers (as
bench_decode). Each config is checked against fp64 under the 2x rule first. Prints JSON lines,
writes argv[1].

    python3 benchmarks/results/h200/session12/sweep_pairs_up.py OUT.json
"""
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "session9"))
from probe_io import emit  # noqa: E402  (puts benchmarks/ on sys.path)
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
    x = a[0]
    ref = ffn_dense(*(None if t is None else t.double() for t in x))
    derr = float((ffn_dense(*x).double() - ref).norm() / ref.norm())
    r = dict(K=k, N=n, M=m, density=d, shipped=dict(pb=base.pb, kc=base.kc, koc=base.koc, warps=base.warps), t={})
    for pb, kc, koc, warps in itertools.product((4, 8, 16), (2048, 1024, 512), (2048, 1024), (4, 8)):
        cfg = base._replace(pb=pb, kc=kc, koc=koc, warps=warps)
        key = f"pb{pb}/kc{kc}/koc{koc}/w{warps}"
        try:
            y = cuda_decode.decode_forward(*x, cfg=cfg, form="pairs").y.double()
            err = float((y - ref).norm() / ref.norm())
            if not err <= 2 * derr:
                r["t"][key] = f"ERR {err:.2e} vs {derr:.2e}"
                continue
            r["t"][key] = round(graph_ms(lambda: [cuda_decode.decode_forward(*x, cfg=cfg, form="pairs")
                                                  for x in a], 30) / len(a) * 1e3, 2)
        except triton.runtime.errors.OutOfResources as e:
            r["t"][key] = f"OOR {str(e)[:40]}"
    r["best"] = sorted((v, kk) for kk, v in r["t"].items() if isinstance(v, float))[:8]
    emit(r)
    print("BEST", m, r["best"][:5], flush=True)
