"""Probe: decode forms on the GPU (correctness + timing per config)."""
import sys, json, time
from pathlib import Path
sys.path.insert(0, "benchmarks")
import torch, torch.nn.functional as F
from bench_decode import graph_ms, weight_sets, layers_for
from twell_compile.kernels import cuda_decode, weight_cache
from twell_compile.kernels.cuda_decode import Config
from twell_compile.reference import ffn_dense
torch.backends.cuda.matmul.allow_tf32 = False
out = []
reps = 30
shapes = [(2048, 5632), (4096, 11008)]
LIST_CFGS = {
  "l_bn32_pb4": dict(bn=32, pb=4), "l_bn32_pb2": dict(bn=32, pb=2), "l_bn32_pb8": dict(bn=32, pb=8),
  "l_bn64_pb4": dict(bn=64, pb=4), "l_bn32_kc1k": dict(bn=32, kc=1024), "l_bn32_le16": dict(bn=32, le=16),
  "l_bn32_bo128": dict(bn=32, bo=128), "l_bn32_gw8": dict(bn=32, gwarps=8), "l_bn16": dict(bn=16),
  "l_bn32_bk128": dict(bn=32, bk=128), "l_bn32_w8": dict(bn=32, warps=8),
}
for k, n in shapes:
    for d in (0.005, 0.02, 0.05):
        sets = weight_sets(64, k, n, d, 0.0, layers_for(k, n, k, True, 256), seed=11)
        for m in (1, 2, 4, 8, 16, 32, 64):
            if d != 0.005 and m not in (4, 16, 64):
                continue
            a = [(p["x"][:m].contiguous(), p["w_gate"], None, p["w_up"], None, p["w_down"], None) for p in sets]
            ref = ffn_dense(*(None if t is None else t.double() for t in a[0]))
            derr = float((ffn_dense(*a[0]).double() - ref).norm() / ref.norm())
            row = dict(M=m, K=k, N=n, d=d, dense=graph_ms(lambda: [ffn_dense(*x) for x in a], reps) / len(a) * 1e3)
            base = cuda_decode.CONFIGS[cuda_decode.m_pad(m)]
            variants = {"default": (base, None), "tiles": (base, "tiles"), "list": (base._replace(bn=32), "list")}
            if m > 4:
                variants.pop("default")
            if m <= 16 or d == 0.005:
                for name, kw in LIST_CFGS.items():
                    if m <= 2 and name not in ("l_bn32_pb4", "l_bn64_pb4"):
                        continue
                    variants[name] = (base._replace(**kw), "list")
            for name, (cfg, form) in variants.items():
                try:
                    y = cuda_decode.decode_forward(*a[0], cfg=cfg, form=form).y
                    err = float((y.double() - ref).norm() / ref.norm())
                    t = graph_ms(lambda: [cuda_decode.decode_forward(*x, cfg=cfg, form=form) for x in a], reps) / len(a) * 1e3
                except Exception as e:
                    print("FAIL", m, k, d, name, repr(e)[:300], flush=True)
                    continue
                row[name] = round(t, 2)
                if err > 2 * derr + 1e-6:
                    row[name + "_ERR"] = (err, derr)
            print(json.dumps(row), flush=True)
            out.append(row)
        del sets
        weight_cache.clear()
        torch.cuda.empty_cache()
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
