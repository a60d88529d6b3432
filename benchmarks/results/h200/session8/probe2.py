"""Session 8 probe 2 (H200): where the decode list/rows forms spend their time, per launch,
M=1 and 16, d=0.005, K=2048 N=5632, CUDA graph over 4 layers (as bench_decode)."""
import sys, json, itertools
sys.path.insert(0, "benchmarks")
import torch, torch.nn.functional as F
from bench_decode import graph_ms, weight_sets, layers_for
from twell_compile.kernels import cuda_decode, weight_cache
from twell_compile.kernels.cuda_decode import _pow2, STAT_BLOCKS
from twell_compile.kernels.twell_decode_list import decode_gather_kernel, decode_pairs_kernel
from twell_compile.reference import ffn_dense
out = sys.argv[1]
res = []
def emit(r):
    print(json.dumps(r), flush=True); res.append(r)
reps = 40
K, N = 2048, 5632

def list_parts(x2, w_gate, w_up, w_down, c):
    """Buffers + two launch closures of cuda_decode._decode_list (no biases, no stats)."""
    m, k = x2.shape
    n, k_out = w_gate.shape[0], w_down.shape[0]
    dev, dt = x2.device, x2.dtype
    mb = min(cuda_decode.m_pad(m), cuda_decode.MAX_MB)
    nrb = -(-m // mb); nb = -(-n // c.lbn)
    y = torch.empty((m, k_out), dtype=dt, device=dev)
    wdt = weight_cache.transposed(w_down)
    iw = torch.empty(m * n + m * nb + nrb * nb * mb + m + 1, dtype=torch.int32, device=dev)
    ln, lc, rc, tok = iw.split([m * n, m * nb, nrb * nb * mb, m + 1])
    fw = torch.empty(m * n + nrb * nb + 1, dtype=torch.float32, device=dev)
    lh, hs, hsum = fw.split([m * n, nrb * nb, 1])
    bk = min(c.bk, max(16, _pow2(k))); kc = min(c.kc, max(16, _pow2(k)))
    def l1():
        decode_pairs_kernel[(nb, nrb)](x2, x2.stride(0), x2.stride(1), w_gate, w_gate.stride(0), w_gate.stride(1),
            w_gate, w_up, w_up.stride(0), w_up.stride(1), w_gate, ln, lh, lc, rc, hs, m, k, n, nb,
            GATED=True, HAS_BG=False, HAS_BU=False, MB=mb, BN=c.lbn, BK=bk, PB=c.pb, KC=kc,
            num_warps=c.warps, num_stages=c.stages)
    bo = min(c.bo, max(16, _pow2(k_out))); no = -(-k_out // bo)
    def l2():
        decode_gather_kernel[(m * no + 1,)](ln, lh, lc, wdt, wdt.stride(0), wdt.stride(1), y, y, y.stride(0), y.stride(1),
            rc, hs, tok, hsum, fw, m, n, k_out, nb, no, nrb, HAS_BD=False, HAS_ST=False, MB=mb, BN=c.lbn,
            NBP=max(16, _pow2(nb)), LE=c.le, BO=bo, RB=STAT_BLOCKS, num_warps=c.gwarps)
    return l1, l2, y

sets = weight_sets(64, K, N, 0.005, 0.0, layers_for(K, N, K, True, 256), seed=11)
quiet = [p["w_gate"].clone() for p in sets]
for q in quiet:
    q[:, 0] = -1e4
L = len(sets)
for m in (1, 16):
    xs = [p["x"][:m].contiguous() for p in sets]
    r = dict(kind="parts", M=m, layers=L)
    r["cublas_gate"] = graph_ms(lambda: [F.linear(x, p["w_gate"]) for x, p in zip(xs, sets)], reps) / L * 1e3
    r["dense"] = graph_ms(lambda: [ffn_dense(x, p["w_gate"], None, p["w_up"], None, p["w_down"], None) for x, p in zip(xs, sets)], reps) / L * 1e3
    c = cuda_decode.CONFIGS[cuda_decode.m_pad(m)]
    for tag, wg in (("act", [p["w_gate"] for p in sets]), ("quiet", quiet)):
        parts = [list_parts(x, g, p["w_up"], p["w_down"], c) for x, g, p in zip(xs, wg, sets)]
        r[f"list_{tag}_l1"] = graph_ms(lambda: [a[0]() for a in parts], reps) / L * 1e3
        r[f"list_{tag}_l2"] = graph_ms(lambda: [a[1]() for a in parts], reps) / L * 1e3
        r[f"list_{tag}_both"] = graph_ms(lambda: [(a[0](), a[1]()) for a in parts], reps) / L * 1e3
        for form in (("rows", "tiles") if m == 1 else ("tiles",)):
            r[f"{form}_{tag}"] = graph_ms(lambda: [cuda_decode.decode_forward(x, g, None, p["w_up"], None, p["w_down"], None, form=form)
                                                   for x, g, p in zip(xs, wg, sets)], reps) / L * 1e3
    emit({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()})
    # list-form config sweep (launch 1 and whole)
    r = dict(kind="list_sweep", M=m)
    base = c
    for lbn, bk, st, pb, kc in itertools.product((16, 32, 64), (128, 256), (3, 5), (4, 8), (1024, 2048)):
        if lbn == 64 and bk == 256:
            continue
        cfg = base._replace(lbn=lbn, bk=bk, stages=st, pb=pb, kc=kc)
        try:
            parts = [list_parts(x, p["w_gate"], p["w_up"], p["w_down"], cfg) for x, p in zip(xs, sets)]
            parts[0][0](); parts[0][1]()
            ref = ffn_dense(xs[0].double(), sets[0]["w_gate"].double(), None, sets[0]["w_up"].double(), None, sets[0]["w_down"].double(), None)
            err = float((parts[0][2].double() - ref).norm() / ref.norm())
            t1 = graph_ms(lambda: [a[0]() for a in parts], reps) / L * 1e3
            tb = graph_ms(lambda: [(a[0](), a[1]()) for a in parts], reps) / L * 1e3
            r[f"{lbn}/{bk}/{st}/{pb}/{kc}"] = [round(t1, 2), round(tb, 2)] if err < 6e-3 else f"ERR {err:.1e}"
        except Exception as e:
            r[f"{lbn}/{bk}/{st}/{pb}/{kc}"] = repr(e)[:60]
    emit(r)
open(out, "w").write(json.dumps(res, indent=1))
