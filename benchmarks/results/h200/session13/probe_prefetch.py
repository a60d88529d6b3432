"""Session 13 probe (H200): does fetching W_gate into L2 before the PDL wait help decode?

With programmatic dependent launch a decode kernel is resident before the previous kernel in
the stream has finished; it only waits (griddepcontrol.wait) before touching memory that
kernel may write. W_gate is never written by it, so its program's W_gate rows can be
requested into L2 before the wait (the weights of nn.Linear do not change inside a forward).
Variants of the shipped kernels are made from their source at run time (string edits, temp
modules; nothing copied into the repo):
  pf_line  per program, prefetch.global.L2 for every 128-byte line of its BN W_gate rows, then wait;
  pf_bulk  the same with one cp.async.bulk.prefetch.L2 per row (Hopper's bulk copy engine);
  early    the finishing launch lets the next launch begin before its own wait (so the next
           layer's prefetch overlaps this layer's up/down, not only its finish);
  pf_bulk+early, pf_line+early.
Timed as bench_decode (one CUDA graph over rotated layers, > 256 MB), K=2048 N=5632 d=0.005:
the pairs form at M=16, 8, 1 and the rows form at M=1; each variant is checked against fp64
under the 2x rule before it is timed. Prints JSON lines, writes argv[1].

    python3 benchmarks/results/h200/session13/probe_prefetch.py OUT.json
"""
import inspect
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "session9"), str(Path(__file__).resolve().parent)]
from variants import module, time_variants  # noqa: E402  (puts the repo root and benchmarks/ on sys.path)

from twell_compile.kernels import cuda_decode, twell_decode, twell_decode_list  # noqa: E402

PF = '''

@triton.jit
def _pf_line(w_ptr, rn, N, sw_n, sw_k, K, BN: tl.constexpr):
    rl = tl.arange(0, 64) * 64                 # every 128-byte line of a bf16 row, K <= 4096
    ok = (rn < N)[:, None] & (rl < K)[None, :]
    p = w_ptr + rn.to(tl.int64)[:, None] * sw_n + rl[None, :] * sw_k
    p = tl.where(ok, p, w_ptr)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [p],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _pf_bulk(w_ptr, rn, N, sw_n, sw_k, K, BN: tl.constexpr):
    ok = rn < N
    p = w_ptr + rn.to(tl.int64) * sw_n
    nbytes = tl.zeros((BN,), dtype=tl.int32) + K * 2
    tl.inline_asm_elementwise(
        "{ .reg .pred q; setp.ne.b32 q, $2, 0; @q cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r", [p, ok.to(tl.int32), nbytes], dtype=tl.int32, is_pure=False, pack=1)
'''
ENTER = "    _pdl_enter(PDL)\n    pid_n = tl.program_id(0)\n"


def pf_enter(kind, bn):
    return (f"    pid_n = tl.program_id(0)\n    _pf_{kind}(wg_ptr, pid_n * {bn} + tl.arange(0, {bn}), N, swg_n, swg_k, K, {bn})\n"
            "    _pdl_enter(PDL)\n")


DSRC = inspect.getsource(twell_decode)
LSRC = inspect.getsource(twell_decode_list)
FIN = "    pid = tl.program_id(0)\n    if pid < tl.num_programs(0) - 1:\n"
EARLY = [("    _pdl_enter(PDL)\n" + FIN, "    if PDL:\n        tl.extra.cuda.gdc_launch_dependents()\n"
          "        tl.extra.cuda.gdc_wait()\n" + FIN)]
shipped = (twell_decode_list.decode_pairs_kernel, twell_decode.decode_fused_kernel, twell_decode.decode_finish_kernel)
VARIANTS = {"shipped": shipped}
for kind in ("line", "bulk"):
    for early in (False, True):
        lm = module(f"l_{kind}{early}", LSRC, [(ENTER, pf_enter(kind, "BN"))], PF)
        dm = module(f"d_{kind}{early}", DSRC, [(ENTER, pf_enter(kind, "BN"))] + (EARLY if early else []), PF)
        VARIANTS[f"pf_{kind}" + ("+early" if early else "")] = (lm.decode_pairs_kernel, dm.decode_fused_kernel,
                                                               dm.decode_finish_kernel)
VARIANTS["early"] = (shipped[0], shipped[1], module("d_early", DSRC, EARLY).decode_finish_kernel)


def use(v):
    twell_decode_list.decode_pairs_kernel, twell_decode.decode_fused_kernel, twell_decode.decode_finish_kernel = v
    cuda_decode._prepared.clear()


time_variants(VARIANTS, use, ((16, "pairs"), (8, "pairs"), (1, "pairs"), (1, "rows")))
