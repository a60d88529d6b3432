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
import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "session9"))
from probe_io import emit  # noqa: E402  (puts the repo root and benchmarks/ on sys.path)
import torch  # noqa: E402

from bench_decode import graph_ms, layers_for, weight_sets  # noqa: E402
from twell_compile.kernels import cuda_decode, twell_decode, twell_decode_list  # noqa: E402
from twell_compile.reference import ffn_dense  # noqa: E402

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


def module(name, src, edits):
    for a, b in edits:
        assert src.count(a) == 1, (name, a[:60])
        src = src.replace(a, b)
    f = Path(tempfile.mkdtemp()) / f"{name}.py"
    f.write_text(src + PF)
    spec = importlib.util.spec_from_file_location(name, f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


DSRC = inspect.getsource(twell_decode)
LSRC = inspect.getsource(twell_decode_list)
FIN = "    pid = tl.program_id(0)\n    if pid < tl.num_programs(0) - 1:\n"
EARLY = [("    _pdl_enter(PDL)\n" + FIN, "    if PDL:\n        tl.extra.cuda.gdc_launch_dependents()\n"
          "        tl.extra.cuda.gdc_wait()\n" + FIN)]
shipped = (twell_decode_list.decode_pairs_kernel, twell_decode.decode_fused_kernel, twell_decode.decode_finish_kernel)
VARIANTS = {"shipped": shipped}
for kind in ("line", "bulk"):
    for early in (False, True):
        lm = module(f"l_{kind}{early}", LSRC, [(ENTER, pf_enter(kind, "BN"))])
        dm = module(f"d_{kind}{early}", DSRC, [(ENTER, pf_enter(kind, "BN"))] + (EARLY if early else []))
        VARIANTS[f"pf_{kind}" + ("+early" if early else "")] = (lm.decode_pairs_kernel, dm.decode_fused_kernel,
                                                               dm.decode_finish_kernel)
VARIANTS["early"] = (shipped[0], shipped[1], module("d_early", DSRC, EARLY).decode_finish_kernel)


def use(v):
    twell_decode_list.decode_pairs_kernel, twell_decode.decode_fused_kernel, twell_decode.decode_finish_kernel = v
    cuda_decode._prepared.clear()


torch.manual_seed(0)
k, n, d = 2048, 5632, 0.005
sets = weight_sets(64, k, n, d, 0.0, layers_for(k, n, k, True, 256), seed=11)
for m, form in ((16, "pairs"), (8, "pairs"), (1, "pairs"), (1, "rows")):
    a = [(p["x"][:m].contiguous(), p["w_gate"], None, p["w_up"], None, p["w_down"], None) for p in sets]
    ref = ffn_dense(*(None if t is None else t.double() for t in a[0]))
    derr = float((ffn_dense(*a[0]).double() - ref).norm() / ref.norm())
    r = dict(K=k, N=n, M=m, form=form, density=d, layers=len(a), pdl=cuda_decode.pdl_ok(a[0][0].device),
             dense_us=round(graph_ms(lambda: [ffn_dense(*x) for x in a], 40) / len(a) * 1e3, 2), us={}, err={})
    for rep in range(3):
        for name, v in VARIANTS.items():
            use(v)
            if rep == 0:
                y = cuda_decode.decode_forward(*a[0], form=form).y.double()
                err = float((y - ref).norm() / ref.norm())
                r["err"][name] = f"{err:.2e} (dense {derr:.2e})"
                assert err <= 2 * derr, (name, err, derr)
            t = graph_ms(lambda: [cuda_decode.decode_forward(*x, form=form) for x in a], 40) / len(a) * 1e3
            r["us"].setdefault(name, []).append(round(t, 2))
    use(shipped)
    r["median"] = {kk: sorted(v)[1] for kk, v in r["us"].items()}
    emit(r)
