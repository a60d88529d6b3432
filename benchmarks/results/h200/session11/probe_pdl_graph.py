"""Session 11 probe (H200): run 11's slow points at K=4096, N=11008, M=1: d=0.2 (tiles form,
op with its own graph 149 us vs 84 without, forced tiles 69) and d=1.0 (dense path, 0.223 ms vs
eager's 0.095). Times the op with graphs on/off x PDL on/off (decode) and the dense path with
and without its graph, and profiles 10 calls of each slow variant. python3 ... OUT.txt"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch  # noqa: E402
from synthetic import make_ffn  # noqa: E402
from timing import median_ms  # noqa: E402

import twell_compile.ops  # noqa: E402,F401
from twell_compile.kernels import cuda_decode, cuda_policy, decode_graphs, weight_cache  # noqa: E402
from twell_compile.kernels import launch as launch_mod  # noqa: E402

lines = []


def say(s):
    print(s, flush=True)
    lines.append(s)


def prof(fn, tag):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    say(f"--- {tag}\n" + p.key_averages().table(sort_by="cuda_time_total", row_limit=8))


with torch.no_grad():
    for d in (0.2, 1.0):
        p = make_ffn(1, 4096, 11008, d, 0.0, device="cuda", seed=1)
        x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
        weight_cache.register(wd)
        for pdl in (True, False):
            cuda_decode.PDL = pdl
            cuda_decode._pdl_devices.clear()
            cuda_decode._prepared.clear()
            launch_mod.clear()
            for graphs in (True, False):
                decode_graphs.ENABLED = graphs
                decode_graphs.clear()
                cuda_policy.reset()
                layer = f"p/{d}/{pdl}/{graphs}"
                op = lambda: torch.ops.twell.ffn(x, wg, None, wu, None, wd, None, 128, 16, layer, False)  # noqa: E731
                for _ in range(40):
                    op()
                torch.cuda.synchronize()
                say(f"d={d} pdl={pdl} graphs={graphs}: op {median_ms(op, 50) * 1e3:.1f} us (graphs held {decode_graphs.count()})")
                if d == 1.0 and graphs:
                    hb = cuda_policy.dense_host_bound
                    cuda_policy.dense_host_bound = lambda *a, **k: True
                    for _ in range(5):
                        op()
                    say(f"   dense path forced graphed: {median_ms(op, 50) * 1e3:.1f} us")
                    cuda_policy.dense_host_bound = hb
                if (d, pdl, graphs) in ((0.2, True, True), (1.0, True, False), (0.2, False, True)):
                    prof(op, f"d={d} pdl={pdl} graphs={graphs}")
        weight_cache.clear()
Path(sys.argv[1]).write_text("\n".join(lines))
