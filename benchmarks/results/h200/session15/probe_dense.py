"""Session 15: the op's dense path at prefill sizes against eager's FFN, interleaved rounds
(bench_ffn.py read the op 5-24% slower than eager at K=4096 dense points, runs 5-7)."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))   # benchmarks/
from synthetic import make_ffn  # noqa: E402
from timing import median_ms  # noqa: E402
import twell_compile.ops  # noqa: E402,F401
from twell_compile.kernels import cuda_infer, cuda_policy, weight_cache  # noqa: E402
from twell_compile.reference import ffn_dense  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
for m, k, n, d in ((16384, 4096, 11008, 0.01), (16384, 2048, 5632, 0.02)):
    p = make_ffn(m, k, n, d, 0.0, device="cuda", seed=3)
    a7 = (p["x"], p["w_gate"], None, p["w_up"], None, p["w_down"], None)
    weight_cache.register(p["w_down"])
    layer = f"probe/{m}/{k}/{d}"
    op = lambda: torch.ops.twell.ffn(*a7, 128, 16, layer, False)
    for _ in range(70):                      # past the first probe and the next one
        op()
    torch.cuda.synchronize()
    key = (layer, p["x"].device, p["x"].dtype, k, n, k, True)
    print(f"M={m} K={k} N={n} d={d}: measured density {cuda_policy.density(key)}, "
          f"use_twell {cuda_policy.use_twell(key, True, k, n, k, 2)}", flush=True)
    fns = {"eager": lambda: ffn_dense(*a7),
           "dense_forward": lambda: cuda_infer.dense_forward(*a7),
           "dense_forward no counts": lambda: cuda_infer.dense_forward(*a7, counts=False),
           "op": op,
           "gate": lambda: F.linear(p["x"], p["w_gate"]),
           "relu_mul_rows": lambda: cuda_infer.relu_mul_rows(F.linear(p["x"], p["w_gate"]), F.linear(p["x"], p["w_up"])),
           "2 linears": lambda: (F.linear(p["x"], p["w_gate"]), F.linear(p["x"], p["w_up"]))}
    res = {name: [] for name in fns}
    for r in range(5):
        for name, f in fns.items():
            res[name].append(median_ms(f, 100))
    for name, v in res.items():
        print(f"  {name:>24}: {' '.join(f'{t:.3f}' for t in v)}  min {min(v):.3f} ms", flush=True)
    del p, a7
