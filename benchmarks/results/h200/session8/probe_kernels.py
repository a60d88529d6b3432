"""Session 8 probes' shared part (Triton kernels must live in a file): the output path
(argv[1]), emit(), graph_us(), and the probe kernels (read, GEMV, row gather)."""
import sys, json, time, itertools
sys.path.insert(0, "benchmarks")
import torch, triton, triton.language as tl
import torch.nn.functional as F
from triton.testing import do_bench

out = sys.argv[1]
res = []
def emit(r):
    print(json.dumps(r), flush=True); res.append(r)

def graph_us(fn, reps=40):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2): fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): fn()
    t = do_bench(g.replay, rep=reps, warmup=10, return_mode="median")
    del g
    return t * 1e3

@triton.jit
def read_kernel(p, o, n, CH: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * CH
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(0, CH, BLOCK):
        off = base + i + tl.arange(0, BLOCK)
        acc += tl.load(p + off, mask=off < n, other=0.0).to(tl.float32)
    tl.store(o + pid, tl.sum(acc, 0))

@triton.jit
def gemv_dot(x_ptr, w_ptr, o_ptr, M, K, N, MB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             KS: tl.constexpr):
    pn = tl.program_id(0); ps = tl.program_id(1)
    rn = pn * BN + tl.arange(0, BN); rm = tl.arange(0, MB); rk = tl.arange(0, BK)
    acc = tl.zeros((MB, BN), tl.float32)
    for k0 in range(ps * KS, ps * KS + KS, BK):
        xk = tl.load(x_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=(rm < M)[:, None], other=0.0)
        w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * K + (k0 + rk)[None, :], mask=(rn < N)[:, None], other=0.0)
        acc = tl.dot(xk, tl.trans(w), acc)
    tl.store(o_ptr + ps * M * N + rm[:, None] * N + rn[None, :], acc, mask=(rm < M)[:, None] & (rn < N)[None, :])

@triton.jit
def gemv_vec(x_ptr, w_ptr, o_ptr, K, N, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr):
    pn = tl.program_id(0); ps = tl.program_id(1)
    rn = pn * BN + tl.arange(0, BN); rk = tl.arange(0, BK)
    acc = tl.zeros((BN, BK), tl.float32)
    for k0 in range(ps * KS, ps * KS + KS, BK):
        xk = tl.load(x_ptr + k0 + rk).to(tl.float32)
        w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * K + (k0 + rk)[None, :], mask=(rn < N)[:, None], other=0.0)
        acc += w.to(tl.float32) * xk[None, :]
    tl.store(o_ptr + ps * N + rn, tl.sum(acc, 1), mask=rn < N)

@triton.jit
def gather_kernel(t_ptr, idx_ptr, o_ptr, P, K: tl.constexpr, PB: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    rk = tl.arange(0, K); rp = tl.arange(0, PB)
    acc = tl.zeros((K,), tl.float32)
    for p0 in range(0, P, PB):
        i = tl.load(idx_ptr + m * P + p0 + rp, mask=(p0 + rp) < P, other=0).to(tl.int64)
        w = tl.load(t_ptr + i[:, None] * K + rk[None, :], mask=((p0 + rp) < P)[:, None], other=0.0)
        acc += tl.sum(w.to(tl.float32), 0)
    tl.store(o_ptr + m * K + rk, acc.to(o_ptr.dtype.element_ty))

