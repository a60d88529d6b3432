"""Session 11 probe (H200): why the op took 0.135 ms at K=4096, N=11008, M=1, d=0.2, tail 0 in
run 10's eager grid (tiles form; 0.085 ms in session 10, 63 us in the CUDA-graph decode grid).
Times the op with and without its own graphs, the forced tiles call, and lists the kernels of
10 op calls under torch.profiler. Run from the repo root: python3 .../probe_tiles.py OUT.txt"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch  # noqa: E402
from synthetic import make_ffn  # noqa: E402
from timing import median_ms  # noqa: E402

import twell_compile.ops  # noqa: E402,F401
from twell_compile.kernels import cuda_decode, cuda_policy, decode_graphs, weight_cache  # noqa: E402

lines = []


def say(s):
    print(s, flush=True)
    lines.append(s)


for d, tail in ((0.2, 0.0), (0.2, 0.2), (0.005, 0.0)):
    p = make_ffn(1, 4096, 11008, d, tail, device="cuda", seed=1)
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    weight_cache.register(wd)
    layer = f"probe/{d}/{tail}"
    op = lambda: torch.ops.twell.ffn(x, wg, None, wu, None, wd, None, 128, 16, layer, False)  # noqa: E731
    with torch.no_grad():
        for _ in range(40):
            op()
        torch.cuda.synchronize()
        st = cuda_policy._state((layer, x.device, x.dtype, 4096, 11008, 4096, True))
        say(f"d={d} tail={tail}: layer density {st.density} form {cuda_policy.use_decode((layer, x.device, x.dtype, 4096, 11008, 4096, True), 1, 4096, 11008, 4096, True)} graphs {decode_graphs.count()}")
        say(f"  op (graphs) {median_ms(op, 50) * 1e3:.1f} us")
        decode_graphs.ENABLED = False
        say(f"  op (no graphs) {median_ms(op, 50) * 1e3:.1f} us")
        decode_graphs.ENABLED = True
        for form in ("tiles", "rows", "pairs"):
            f = lambda: cuda_decode.decode_forward(x, wg, None, wu, None, wd, None, form=form)  # noqa: E731
            say(f"  forced {form} (eager) {median_ms(f, 50) * 1e3:.1f} us")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                op()
            torch.cuda.synchronize()
        say(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    weight_cache.clear()
    decode_graphs.clear()
Path(sys.argv[1]).write_text("\n".join(lines))
