"""Session 13 probe (H200): the floor of reading one decode gate's bytes in a CUDA graph.

cuBLAS's gate GEMV (x W_g^T, K=2048 N=5632 bf16, 23 MB) takes 11.3 us per layer over rotated
layers in one graph (session 12, probe_gate.py): 2.0 TB/s against a 4.2 TB/s copy. Is that
the memory system's floor for a 23 MB kernel here, or the GEMV's? A plain Triton read (sum of
a contiguous 23 MB buffer, G programs each reading 23 MB / G in BLOCK-element loads) over
the same rotation (4 buffers, one graph), over G, warps, stages and PDL; cuBLAS M=1 in the
same run. Prints JSON lines, writes argv[1].

    python3 benchmarks/results/h200/session13/probe_read.py OUT.json
"""
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "session9"))
from probe_io import emit  # noqa: E402  (puts the repo root and benchmarks/ on sys.path)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench_decode import graph_ms  # noqa: E402


@triton.jit
def read_kernel(p, out, per, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    base = p + pid.to(tl.int64) * per
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, per, BLOCK):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out + pid, tl.sum(acc, axis=0))


torch.manual_seed(0)
n, k = 5632, 2048
ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
xs = [torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _ in ws]
r = dict(bytes=n * k * 2, buffers=len(ws), us={})
r["us"]["cublas_gemv_m1"] = round(graph_ms(lambda: [F.linear(x, w) for x, w in zip(xs, ws)], 40) / len(ws) * 1e3, 2)
out = torch.empty(4096, device="cuda", dtype=torch.float32)
for g, block, warps, stages, pdl in itertools.product((128, 176, 256, 352, 512, 704, 1024, 1408, 2816),
                                                      (2048, 8192), (4, 8), (1, 3), (False, True)):
    per = n * k // g
    if per * g != n * k or per % block:
        continue

    def fn():
        for w in ws:
            read_kernel[(g,)](w, out, per, BLOCK=block, PDL=pdl, num_warps=warps, num_stages=stages,
                              **({"launch_pdl": True} if pdl else {}))
    fn()
    torch.cuda.synchronize()
    want = ws[-1].float().view(g, per).sum(1)
    assert torch.allclose(out[:g], want, rtol=1e-3, atol=1e-1), (g, block)
    r["us"][f"g{g}/b{block}/w{warps}/s{stages}/pdl{int(pdl)}"] = round(graph_ms(fn, 40) / len(ws) * 1e3, 2)
r["best"] = sorted((v, kk) for kk, v in r["us"].items())[:10]
emit(r)
print("BEST", r["us"]["cublas_gemv_m1"], r["best"], flush=True)
