"""Session 12 probe (H200): how fast can the decode gate read W_gate? probe_parts.py put the
pairs form's gate-only variant at 13.2 us (K=2048, N=5632, 23 MB; with its finish launch)
against 15.6-19.7 us for the whole FFN. Here, over the same rotated layers in one CUDA graph:
cuBLAS x W_g^T (M=1, 16), and a plain Triton GEMV for M=1 (BN rows of W_g per program, FMA
reduction, no tl.dot) over a small config sweep. Prints JSON lines, writes argv[1].

    python3 benchmarks/results/h200/session12/probe_gate.py OUT.json
"""
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "session9"))
from probe_io import emit  # noqa: E402  (puts benchmarks/ on sys.path)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench_decode import graph_ms, layers_for, weight_sets  # noqa: E402


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, K, N, BN: tl.constexpr, BK: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = rn < N
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        xk = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * K + kk[None, :], mask=n_ok[:, None] & (kk < K)[None, :],
                    other=0.0)
        acc += w.to(tl.float32) * xk[None, :]
    tl.store(y_ptr + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_ok)


torch.manual_seed(0)
k, n, d = 2048, 5632, 0.005
sets = weight_sets(64, k, n, d, 0.0, layers_for(k, n, k, True, 256), seed=11)
ws = [p["w_gate"] for p in sets]
r = dict(K=k, N=n, layers=len(ws), us={})
for m in (1, 16):
    xs = [p["x"][:m].contiguous() for p in sets]
    r["us"][f"cublas_m{m}"] = round(graph_ms(lambda: [F.linear(x, w) for x, w in zip(xs, ws)], 40) / len(ws) * 1e3, 2)
xs = [p["x"][:1].contiguous() for p in sets]
ys = [torch.empty(1, n, dtype=x.dtype, device=x.device) for x in xs]
ref = F.linear(xs[0].float(), ws[0].float())
for bn, bk, warps, stages in itertools.product((4, 8, 16), (256, 512), (4, 8), (1, 3)):
    def fn():
        for x, w, y in zip(xs, ws, ys):
            gemv_kernel[(triton.cdiv(n, bn),)](x, w, y, k, n, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    fn()
    err = float((ys[0].float() - ref).norm() / ref.norm())
    key = f"bn{bn}/bk{bk}/w{warps}/s{stages}"
    r["us"][key] = round(graph_ms(fn, 40) / len(ws) * 1e3, 2) if err < 1e-2 else f"ERR {err:.1e}"
r["best"] = sorted((v, kk) for kk, v in r["us"].items() if isinstance(v, float))[:6]
emit(r)
