"""Session 8 probe (H200): (a) read-bandwidth ceiling for one 23 MB weight per launch, (b) gate
GEMV variants (tl.dot MB=16, split-K; M=1 without dot), (c) L2 row-gather ceiling for the
per-row inference kernel, (d) host time per call by entry point. Prints JSON lines."""
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

# (c) L2 gather ceiling: a 46 MB table (W_up + W_down^T rows), P random rows per token
M = 16384
tab = torch.randn(2 * N, K, device=dev, dtype=torch.bfloat16)
yo = torch.empty(M, K, device=dev, dtype=torch.bfloat16)
r = dict(kind="gather", M=M, table_MB=round(tab.numel() * 2 / 1e6, 1))
for P in (0, 28, 56, 112):
    idx = torch.randint(0, 2 * N, (M, max(P, 1)), device=dev, dtype=torch.int32)
    for pb, warps in ((4, 4), (8, 4), (8, 8), (16, 8)):
        t = do_bench(lambda: gather_kernel[(M,)](tab, idx, yo, P, K=K, PB=pb, num_warps=warps), rep=50, return_mode="median")
        r[f"P{P}/{pb}/{warps}"] = round(t * 1e3, 1)
        if P:
            r[f"P{P}/{pb}/{warps}_TBps"] = round(M * P * K * 2 / (t * 1e-3) / 1e12, 2)
emit(r)
del tab
torch.cuda.empty_cache()

# (d) host time per call by entry point
import twell_compile.ops  # noqa
from twell_compile import dispatch
from twell_compile.kernels import cuda_infer, cuda_decode, weight_cache
from synthetic import make_ffn
def host_us(fn, n=300):
    for _ in range(30): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): fn()
    h = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return round(h, 1)
for m in (1, 64, 1024):
    p = make_ffn(m, K, N, 0.005, 0.0, device=dev, seed=1)
    weight_cache.register(p["w_down"])
    a = (p["x"], p["w_gate"], None, p["w_up"], None, p["w_down"], None)
    r = dict(kind="host", M=m)
    r["op"] = host_us(lambda: torch.ops.twell.ffn(*a, 128, 16, f"h/{m}", False))
    with torch.inference_mode():
        r["op_inference_mode"] = host_us(lambda: torch.ops.twell.ffn(*a, 128, 16, f"h/{m}", False))
    r["op_default"] = host_us(lambda: torch.ops.twell.ffn.default(*a, 128, 16, f"h/{m}", False))
    r["dispatch"] = host_us(lambda: dispatch.ffn_infer(*a, 128, 16, f"h/{m}", False))
    r["cuda_infer"] = host_us(lambda: cuda_infer.ffn_infer(*a, 128, 16, f"h/{m}", False))
    r["dense_forward"] = host_us(lambda: cuda_infer.dense_forward(*a))
    if m <= 64:
        for form in ("rows", "list", "tiles"):
            if form == "rows" and m > 4:
                continue
            r[f"decode_{form}"] = host_us(lambda: cuda_decode.decode_forward(*a, form=form))
    r["eager_dense"] = host_us(lambda: F.linear(F.relu(F.linear(a[0], a[1])) * F.linear(a[0], a[3]), a[5]))
    r["empty_op_linear"] = host_us(lambda: F.linear(a[0], a[1]))
    emit(r)
    weight_cache.clear()
open(out, "w").write(json.dumps(res, indent=1))
