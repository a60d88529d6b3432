"""Session 8 probe 1 (H200): (a) read-bandwidth ceiling for one 23 MB weight per launch, (b) gate
GEMV variants (tl.dot MB=16, split-K; M=1 without tl.dot). Prints JSON lines, writes argv[1].
The L2 row-gather ceiling and host time per call ran in probe3.py (probe3_tail.py).

    python3 benchmarks/results/h200/session8/probe.py OUT.json        # from the repo root
"""
import sys, itertools
sys.path.insert(0, "benchmarks/results/h200/session8")
import torch
import torch.nn.functional as F
from probe_kernels import (emit, gemv_dot, gemv_vec, graph_us, out, read_kernel,  # noqa: F401
                           res, json)

dev = "cuda"
torch.manual_seed(0)
K, N = 2048, 5632
L = 12   # 12 x 23 MB = 277 MB per pass, as the decode bench's 4 layers x 3 weights
ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(L)]
o = torch.empty(1 << 16, device=dev, dtype=torch.float32)
nel = N * K
r = dict(kind="read", MB=round(nel * 2 / 1e6, 1))
for grid, warps, block in itertools.product((132, 264, 528, 1056, 2112, 4224), (4, 8), (2048, 4096)):
    ch = -(-nel // grid); ch = -(-ch // block) * block
    g = -(-nel // ch)
    t = graph_us(lambda: [read_kernel[(g,)](w, o, nel, CH=ch, BLOCK=block, num_warps=warps) for w in ws]) / L
    r[f"{grid}/{warps}/{block}"] = round(t, 2)
r["cublas_M1"] = round(graph_us(lambda: [F.linear(xx, w) for xx, w in zip([torch.randn(1, K, device=dev, dtype=torch.bfloat16)] * L, ws)]) / L, 2)
x16 = torch.randn(16, K, device=dev, dtype=torch.bfloat16)
r["cublas_M16"] = round(graph_us(lambda: [F.linear(x16, w) for w in ws]) / L, 2)
emit(r)

for m in (1, 16):
    x = torch.randn(m, K, device=dev, dtype=torch.bfloat16)
    ref = F.linear(x.float(), ws[0].float())
    r = dict(kind="gemv_dot", M=m)
    for bn, bk, split, warps, stages in itertools.product((16, 32, 64), (128, 256), (1, 2, 4), (4,), (3, 5)):
        ob = torch.empty(split * 16 * N, device=dev, dtype=torch.float32)
        fn = lambda: [gemv_dot[(-(-N // bn), split)](x, w, ob, m, K, N, MB=16, BN=bn, BK=bk, KS=K // split,
                                                    num_warps=warps, num_stages=stages) for w in ws]
        try:
            fn(); torch.cuda.synchronize()
            err = float((ob[:split * m * N].view(split, m, N).sum(0) - F.linear(x.float(), ws[-1].float())).abs().max())
            t = graph_us(fn) / L
            r[f"{bn}/{bk}/{split}/{warps}/{stages}"] = round(t, 2) if err < 1e-2 else f"ERR {err:.1e}"
        except Exception as e:
            r[f"{bn}/{bk}/{split}/{warps}/{stages}"] = repr(e)[:60]
    emit(r)
x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
r = dict(kind="gemv_vec", M=1)
for bn, bk, split, warps in itertools.product((4, 8, 16), (512, 1024), (1, 2, 4), (4, 8)):
    if bk > K // split:       # the first run read past the rows here (illegal address)
        continue
    ob = torch.empty(split * N, device=dev, dtype=torch.float32)
    fn = lambda: [gemv_vec[(-(-N // bn), split)](x, w, ob, K, N, BN=bn, BK=bk, KS=K // split, num_warps=warps) for w in ws]
    try:
        fn(); torch.cuda.synchronize()
        err = float((ob.view(split, N).sum(0) - F.linear(x.float(), ws[-1].float())[0]).abs().max())
        r[f"{bn}/{bk}/{split}/{warps}"] = round(graph_us(fn) / L, 2) if err < 1e-2 else f"ERR {err:.1e}"
    except Exception as e:
        r[f"{bn}/{bk}/{split}/{warps}"] = repr(e)[:60]
emit(r)
del ws
torch.cuda.empty_cache()

open(out, "w").write(json.dumps(res, indent=1))
