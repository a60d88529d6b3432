"""Session 9 probe (H200): why the compiled decode step gains at batch 1 but not at batch 8.
The bench_e2e model (16 layers, d=0.005 calibrated), compiled as generate() compiles it
(reduce-overhead), 40 greedy one-token steps under torch.profiler per backend: wall ms per
step, summed kernel time per step, the top kernels, and each twell layer's density and
decode decision. Prints JSON lines, writes argv[1].

    python3 benchmarks/results/h200/session9/probe_e2e.py OUT.json 1 8
"""
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_io import compiled_decode_steps, emit  # noqa: E402  (puts the repo root and benchmarks/ on sys.path)
import torch  # noqa: E402
import transformers  # noqa: E402

from twell_compile.kernels import cuda_policy  # noqa: E402

for batch, a, prompt, name, m, compiled in compiled_decode_steps(int(v) for v in sys.argv[2:]):
    steps = 40
    cache = transformers.StaticCache(config=m.config, max_cache_len=a.seq + steps + 8)
    with torch.no_grad():
        o = m(input_ids=prompt, past_key_values=cache, use_cache=True,
              cache_position=torch.arange(a.seq, device="cuda"))
        tok = o.logits[:, -1:].argmax(-1)
        pos = torch.full((1,), a.seq, device="cuda", dtype=torch.long)
        for _ in range(4):                      # warm: graphs recorded
            o = compiled(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos)
            tok = o.logits[:, -1:].argmax(-1)
            pos = pos + 1
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                o = compiled(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos)
                tok = o.logits[:, -1:].argmax(-1)
                pos = pos + 1
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3 / steps
    kern = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kern[e.name[:90]]
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    total = sum(v[1] for v in kern.values()) / steps / 1e3
    top = sorted(kern.items(), key=lambda kv: -kv[1][1])[:14]
    r = dict(batch=batch, backend=name, wall_ms_per_step=round(wall, 3), kernel_ms_per_step=round(total, 3),
             kernels_per_step=round(sum(v[0] for v in kern.values()) / steps, 1),
             top=[(n, c // steps, round(t / steps, 1)) for n, (c, t) in top])
    if name == "twell":
        lay = {}
        for key, st in cuda_policy._layers.items():
            d = st.density
            lay[str(key[0])] = dict(density=None if d is None else round(d, 5),
                                    decision=cuda_policy.use_decode(key, batch, 2048, 5632, 2048, True)
                                    if d is not None else None)
        r["layers"] = lay
    emit(r)
    del m, compiled, cache       # (compiled_decode_steps then empties the CUDA cache)
