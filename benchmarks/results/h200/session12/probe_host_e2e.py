"""Session 12 probe (H200): is the compiled decode step of bench_e2e host-bound? The bench_e2e
model (16 layers, d=0.005 calibrated), compiled as generate() compiles it (reduce-overhead),
greedy one-token steps as bench_e2e's step loop, per backend: wall ms per step, host ms per
step (until the last call returns, before the sync: if it equals the wall, the host sets the
pace), and GPU ms per step (CUDA events around the loop). 5 rounds of 64 steps, medians.
Prints JSON lines, writes argv[1].

    python3 benchmarks/results/h200/session12/probe_host_e2e.py OUT.json 1 8
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "session9"))
from probe_io import compiled_decode_steps, emit  # noqa: E402  (puts the repo root and benchmarks/ on sys.path)
import torch  # noqa: E402
import transformers  # noqa: E402

for batch, a, prompt, name, m, compiled in compiled_decode_steps(int(v) for v in sys.argv[2:]):
    steps = 64
    walls, hosts, gpus, one = [], [], [], []
    with torch.no_grad():
        for r in range(7):
            cache = transformers.StaticCache(config=m.config, max_cache_len=a.seq + steps + 8)
            o = m(input_ids=prompt, past_key_values=cache, use_cache=True,
                  cache_position=torch.arange(a.seq, device="cuda"))
            tok = o.logits[:, -1:].argmax(-1)
            pos = torch.full((1,), a.seq, device="cuda", dtype=torch.long)
            for _ in range(3):              # graphs recorded in the first rounds
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                o = compiled(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos)
                one.append((time.perf_counter() - t0) * 1e3)
                tok = o.logits[:, -1:].argmax(-1)
                pos = pos + 1
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            e0.record()
            for _ in range(steps):
                o = compiled(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos)
                tok = o.logits[:, -1:].argmax(-1)
                pos = pos + 1
            e1.record()
            th = time.perf_counter()
            torch.cuda.synchronize()
            tw = time.perf_counter()
            if r >= 2:
                walls.append((tw - t0) * 1e3 / steps)
                hosts.append((th - t0) * 1e3 / steps)
                gpus.append(e0.elapsed_time(e1) / steps)
    md = lambda v: round(statistics.median(v), 4)  # noqa: E731
    emit(dict(batch=batch, backend=name, wall_ms_per_step=md(walls), host_ms_per_step=md(hosts),
              gpu_ms_per_step=md(gpus), one_call_host_ms=md(one[6:]),
              walls=[round(v, 4) for v in walls], hosts=[round(v, 4) for v in hosts]))
    del m, compiled, cache       # (compiled_decode_steps then empties the CUDA cache)
