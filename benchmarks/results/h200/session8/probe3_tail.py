# Sections (c) and (d) of the session 8 probes, run by probe3.py (exec in its namespace, after
# probe_kernels is imported): L2 row-gather ceiling, host time per call by entry point.
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
