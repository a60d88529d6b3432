"""Session 10 probe: host (CPU) time per call of each layer of the CUDA inference op, and of
the pieces a leaner launch path would use. Prints JSON lines; writes all of them to argv[1].

    PYTHONPATH=. python3 benchmarks/results/h200/session10/probe_host.py OUT.json
"""
import inspect
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from synthetic import make_ffn  # noqa: E402

import twell_compile.ops  # noqa: E402,F401
from twell_compile import dispatch  # noqa: E402
from twell_compile.kernels import cuda_decode, cuda_infer, cuda_policy, weight_cache  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks" / "results" / "h200" / "session9"))
from bench_host import per_call_us  # noqa: E402
from probe_io import emit  # noqa: E402  (writes every result so far to argv[1])


def host_us(fn, n=600):
    return tuple(round(v, 2) for v in per_call_us(fn, n))


import triton  # noqa: E402
from triton.compiler.compiler import CompiledKernel  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

emit({"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name()})
src = inspect.getsource(JITFunction.run)
emit({"jit_run_tail": src[-900:]})
emit({"ck_getitem": inspect.getsource(CompiledKernel.__getitem__)})

# null ops: custom_op vs Library, CUDA tensors
from typing import Optional  # noqa: E402
from torch import Tensor  # noqa: E402


@torch.library.custom_op("probe::a", mutates_args=())
def a(x: Tensor, w: Tensor, b: Optional[Tensor], t: int, layer: str, s: bool) -> Tensor:
    return torch.empty_like(x)


lib = torch.library.Library("probe2", "DEF")
lib.define("b(Tensor x, Tensor w, Tensor? b, int t, str layer, bool s) -> Tensor")
lib.impl("b", lambda x, w, b, t, layer, s: torch.empty_like(x), "CUDA")
x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
w = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
emit({"case": "null custom_op", "us": host_us(lambda: torch.ops.probe.a(x, w, None, 3, "l", False))})
emit({"case": "null Library op", "us": host_us(lambda: torch.ops.probe2.b(x, w, None, 3, "l", False))})
emit({"case": "torch.empty_like", "us": host_us(lambda: torch.empty_like(x))})
emit({"case": "torch.empty", "us": host_us(lambda: torch.empty(100, device="cuda"))})
emit({"case": "is_capturing", "us": host_us(lambda: torch.cuda.is_current_stream_capturing())})
emit({"case": "deterministic?", "us": host_us(lambda: torch.are_deterministic_algorithms_enabled())})
from triton.runtime.driver import driver  # noqa: E402
emit({"case": "triton get_current_stream", "us": host_us(
    lambda: driver.active.get_current_stream(driver.active.get_current_device()))})
emit({"case": "torch raw stream", "us": host_us(lambda: torch._C._cuda_getCurrentRawStream(0))})
emit({"case": "data_ptr x10", "us": host_us(lambda: [x.data_ptr() for _ in range(10)])})

k, n = 2048, 5632
for m in [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else (1, 16, 64, 1024):
    p = make_ffn(m, k, n, 0.005, 0.0, device="cuda", seed=1)
    xx, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    weight_cache.register(wd)
    layer = f"probe/{m}"
    args7 = (xx, wg, None, wu, None, wd, None)
    key = (layer, xx.device, xx.dtype, k, n, k, True)
    r = {"M": m}
    r["op"] = host_us(lambda: torch.ops.twell.ffn(*args7, 128, 16, layer, False))
    with torch.inference_mode():
        r["op_inference_mode"] = host_us(lambda: torch.ops.twell.ffn(*args7, 128, 16, layer, False))
    r["check"] = host_us(lambda: twell_compile.ops._check(*args7))
    r["dispatch"] = host_us(lambda: dispatch.ffn_infer(*args7, 128, 16, layer, False))
    r["cuda_infer"] = host_us(lambda: cuda_infer.ffn_infer(*args7, 128, 16, layer, False))
    r["decode_ok+wins0"] = host_us(lambda: cuda_policy.decode_ok(xx, m, n)
                                   and cuda_policy.decode_wins(0.0, m, k, n, k, True))
    if m <= 64:
        r["use_decode"] = host_us(lambda: cuda_policy.use_decode(key, m, k, n, k, True))
        form = cuda_policy.use_decode(key, m, k, n, k, True)
        r["form"] = form
        r["wants_probe+tick"] = host_us(lambda: (cuda_policy.wants_probe(key, True), cuda_policy.tick(key)))
        for f in ("rows", "pairs", "tiles") if m <= 4 else ("pairs", "tiles"):
            r[f"decode_forward[{f}]"] = host_us(
                lambda: cuda_decode.decode_forward(xx, wg, None, wu, None, wd, None, form=f))
    else:
        r["dense_forward"] = host_us(lambda: cuda_infer.dense_forward(xx, wg, None, wu, None, wd, None))
    r["F.linear"] = host_us(lambda: F.linear(xx, wg))
    eager = lambda: F.linear(F.relu(F.linear(xx, wg)) * F.linear(xx, wu), wd)  # noqa: E731
    r["eager_dense"] = host_us(eager)
    comp = torch.compile(lambda x_, a_, b_, c_: F.linear(F.relu(F.linear(x_, a_)) * F.linear(x_, b_), c_),
                         dynamic=False)
    r["inductor_dense"] = host_us(lambda: comp(xx, wg, wu, wd))
    emit(r)

# Triton launch: standard vs the compiled kernel's own launcher
from twell_compile.kernels.twell_decode import decode_finish_kernel  # noqa: E402

m, ko = 16, 2048
acc = torch.randn(m * ko, device="cuda")
y = torch.empty(m, ko, device="cuda", dtype=torch.bfloat16)
rc = torch.zeros(4 * 176 * 16, dtype=torch.int32, device="cuda")
hs = torch.zeros(176, device="cuda")
tok = torch.empty(m + 1, dtype=torch.int32, device="cuda")
hsum = torch.empty(1, device="cuda")
grid = (-(-(m * ko) // 1024) + 1, 1, 1)
pos = (acc, y, y, y.stride(0), y.stride(1), rc, hs, tok, hsum, hs, m, ko, 176, 1)
kw = dict(HAS_BD=False, CLEAN=False, HAS_ST=False, MB=16, BLOCK=1024, RB=256)


def std():
    return decode_finish_kernel[grid](*pos, **kw, num_warps=4)


ck = std()
torch.cuda.synchronize()
ref = y.clone()
names = decode_finish_kernel.arg_names
full = list(pos) + [kw[nm] for nm in names[len(pos):]]
runner = ck[grid]
stream = torch.cuda.current_stream().cuda_stream
y.fill_(7)
runner(*full, stream=stream)
torch.cuda.synchronize()
emit({"ck_runner_equal": bool(torch.equal(y, ref)), "names": names})
emit({"case": "triton std launch (finish, 20 args)", "us": host_us(std)})
emit({"case": "ck runner launch", "us": host_us(lambda: runner(*full, stream=stream))})
run = ck.run
fn_, pm = ck.function, ck.packed_metadata
emit({"case": "ck.run direct", "us": host_us(
    lambda: run(grid[0], 1, 1, stream, fn_, pm, None, None, None, *full))})
emit({"case": "ck.run direct + raw stream", "us": host_us(
    lambda: run(grid[0], 1, 1, torch._C._cuda_getCurrentRawStream(0), fn_, pm, None, None, None, *full))})


def pykey(args):
    return tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else
                 (a == 1, a % 16 == 0) if isinstance(a, int) and not isinstance(a, bool) else a
                 for a in args)


emit({"case": "python spec key (20 args)", "us": host_us(lambda: pykey(full))})
print("done")
