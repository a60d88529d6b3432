"""Session 14 probe (H200): does generate() re-record CUDA graphs per call, per backend? Run 10:
at batch 16 twell's generate() took 2.417 ms per token against Inductor's 2.265 while its step
loop was 1.19x faster; run 11 saw a cudagraph-tree re-record inside single calls. Here: 6
generate() calls (48 new tokens) per backend and batch after 3 warm ones, each call's wall time
and its counts of CUDAGraphTreeManager.record_function / run_eager (warm-up) calls, and the
op's eager calls (twell::ffn outside any graph).

    python3 benchmarks/results/h200/session14/probe_rerecord.py OUT.json [BATCH ...]
"""
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "session9"))
from probe_io import backend_generate, calibrated_model, emit  # noqa: E402  (puts the repo root and benchmarks/ on sys.path)
import torch  # noqa: E402
import torch._inductor.cudagraph_trees as cgt  # noqa: E402

import bench_e2e as be  # noqa: E402

NEW = 48
BATCHES = [int(v) for v in sys.argv[2:]] or [16]
calls = Counter()


def counting(name):
    orig = getattr(cgt.CUDAGraphTreeManager, name)

    def wrapped(self, *args, **kwargs):
        calls[name] += 1
        return orig(self, *args, **kwargs)
    setattr(cgt.CUDAGraphTreeManager, name, wrapped)


for name in ("record_function", "run_eager"):
    counting(name)

a, model = calibrated_model(max(BATCHES), NEW)
for batch in BATCHES:
    prompt = be.token_batch(a, batch, a.seq, a.seed + 2)
    for name in ("inductor", "twell"):
        m, kw = backend_generate(name, a, model, prompt)
        per_call = []
        with torch.no_grad():
            for i in range(9):
                calls.clear()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                m.generate(prompt, **kw)
                torch.cuda.synchronize()
                per_call.append(dict(ms=round((time.perf_counter() - t0) * 1e3, 2), **calls))
        emit(dict(backend=name, batch=batch, new_tokens=NEW, calls=per_call))
        print(name, batch, per_call, flush=True)
        del m
        torch._dynamo.reset()
