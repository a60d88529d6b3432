"""Where a training step's time goes, part by part: our sparse FFN training path against the
paper's hybrid kernels (and eager / Inductor whole steps for scale), one row per part.

    python3 benchmarks/train_parts.py --out runs/h100/train_parts.json \
        [--reference .anchor/sparser-faster-llms] [--M 16384 65536] [--reps 300] [--rounds 3]
    TRITON_INTERPRET=1 python3 benchmarks/train_parts.py --smoke     # CPU: tiny shapes, fp16

Inputs: bench_ffn_train.py's (timing.train_inputs, the same seed per point): bf16, gated, no
biases, K=2048, N=5632, density 0.005 i.i.d. (anchors.md's generator), tail 0; dy random.

Ours (impl "ours", the sparse path the op's path="twell" runs; launch sizes from the GPU's
record): each part is the runtime function the op calls, on the state the previous part left,
timed by do_bench (CUDA events, L2 flushed per call) in interleaved rounds (timing.interleaved_ms)
with every other variant of the point. OURS_PARTS names each part's function and launches.
Two parts repeat calls that consume something: fwd.up_down repeats train_fwd_kernel on one
compaction (identical work while no row is busier than the ELL width: ``busy_rows`` in the rows
says; see cuda_train.packed_forward), and the two weight-gradient passes take their chunks from
an atomic ticket, so their timed call zeroes it first (one memset of a few bytes, included).
Whole steps through autograd, as bench_ffn_train.py times them: the op with path="twell"
(step.sparse), the op as the backend runs it (path="auto", step.op, the path it took in ``path``),
eager (impl "eager") and Inductor (impl "inductor").

The paper's (impl "paper", with --reference DIR, the sparser-faster-llms folder carried as
../shared/anchor/README.md says): benchmarks/reference.py --train-parts in a process of its own
per point (it crashes on some points): their op exposes its forward and backward whole only,
so do_bench of the forward (no_grad) and of forward + backward, the backward by CUDA events after
a fresh forward each sample (timing.after_ms), and step - forward (reference.PAPER_PARTS).

Device time per part (method "kernels", both sides, unless --no-kernels): a few steps under
torch.profiler, each step's launches in device order cut into forward and backward by a marker
kernel (timing.kernel_phases) and labelled by name and position (``classify_ours`` here,
reference.classify_paper for theirs): summed kernel time, no launch gaps, the one measure that
splits their op into pieces. Every row: rows.py's stamp (the GPU named there), then M, K, N,
density, tail, activity, dtype, impl, part, method, ms, launches, status ("ok", or "skipped:
why" / the reference's "crashed ..." with ms NaN); written to --out (default
runs/<gpu>/train_parts.json) after every point; a table at the end.
--smoke: M=64, K=64, N=160, fp16 on the CPU: our parts run through the Triton interpreter
(TRITON_INTERPRET=1; without it they are skipped, as are everything that needs CUDA: the op's
CUDA path, Inductor, the paper's kernels, the profiler breakdown), timed by the host clock.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional

import torch

if __package__ in (None, ""):                  # run as a file: python3 benchmarks/train_parts.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import reference  # noqa: E402
from benchmarks.reference import fill_or_copy  # noqa: E402
from benchmarks.rows import out_path, stamp, write_json  # noqa: E402
from benchmarks.timing import bench, gpu_name, interleaved_ms, kernel_parts, kernel_phases, mark_phase, \
    train_inputs  # noqa: E402

import twell_compile.ops  # noqa: E402,F401  (registers torch.ops.twell)
from twell_compile.config import TwellConfig  # noqa: E402
from twell_compile.formats import backup_capacity  # noqa: E402
from twell_compile.reference import ffn_dense  # noqa: E402
from twell_compile.runtime import cuda_train, density  # noqa: E402
from twell_compile.runtime.cuda_infer import record_stats  # noqa: E402
from twell_compile.runtime.launch import INTERPRET, unit_rows  # noqa: E402

NAN = float("nan")

# (part, method, the function timed and the launches it makes), in table order
OURS_PARTS = (
    ("fwd.gate_gemm", "do_bench", "cuda_train.gate_gemm: g = x W_g^T, one cuBLAS GEMM"),
    ("fwd.pack", "do_bench", "cuda_train.pack_gate: the state's zeroed buffers (memsets) + compact_rows_kernel "
                             "(count and first W (col, value) pairs of relu(g) per row, rows' order)"),
    ("fwd.stats", "do_bench", "cuda_infer.record_stats: row_stats_kernel, one launch (run by the op when it keeps "
                              "statistics; not in fwd or the steps here, as in bench_ffn_train.py)"),
    ("fwd.up_down", "do_bench", "cuda_train.packed_forward: transpose_kernel (W_d^T) + train_fwd_kernel "
                                "(u at the pairs, y, the ELL slots and dense backup)"),
    ("fwd", "do_bench", "cuda_train.forward_sparse: gate GEMM + pack + up/down"),
    ("bwd.setup", "do_bench", "cuda_train.sparse_bwd_setup: allocations, backup_rows_kernel (slots, x / dy rows), "
                              "rank_kernel, train_bwd_kernel (busy rows), wgrad_plan_kernel (offsets, chunks) + "
                              "scatter_kernel (sort by neuron), 3 cuBLAS products of the backup rows, "
                              "chunk_map_kernel"),
    ("bwd.wgrad_dy", "do_bench", "cuda_train.sparse_bwd_dy_pass: wgrad_kernel DY pass (dh, d_g, d_u at the slots, "
                                 "dW_down, bias sums; dy rows gathered), after zeroing its ticket"),
    ("bwd.wgrad_x", "do_bench", "cuda_train.sparse_bwd_x_pass: wgrad_kernel X pass (dW_gate, dW_up; x rows gathered), "
                                "after zeroing its tickets"),
    ("bwd.dx", "do_bench", "cuda_train.sparse_bwd_dx: dx_rows_kernel (the quiet rows' dx from W_g, W_u rows)"),
    ("bwd.outputs", "do_bench", "cuda_train.sparse_bwd_outputs: fp32 -> dtype casts, transpose_kernel (dW_down)"),
    ("bwd", "do_bench", "cuda_train.backward_sparse: the five stages above"),
    ("fwd+bwd", "do_bench", "forward_sparse then backward_sparse (runtime calls, no autograd)"),
    ("step.sparse", "do_bench", "torch.ops.twell.ffn_train path='twell' + its backward through autograd"),
    ("step.op", "do_bench", "the op with path='auto' (the product: its rules pick the path; ``path`` says which)"),
)
# Device-time parts of one op step (path='twell'; classify_ours's labels), in table order.
OURS_KERNEL_PARTS = (
    ("fwd.gate_gemm", "the forward's launches before compact_rows_kernel (the cuBLAS gate GEMM)"),
    ("fwd.pack", "compact_rows_kernel"),
    ("fwd.stats", "row_stats_kernel (only where the op keeps statistics)"),
    ("fwd.up_down", "train_fwd_kernel and W_d^T's transpose_kernel"),
    ("fwd.other", "the forward's other launches (the lost-row count, the density probe)"),
    ("fwd.fill_copy", "the forward's fills, memsets and copies (the state's zeroed buffers)"),
    ("bwd.setup", "the backward's launches before the first wgrad_kernel (backup rows, ranks, busy rows, sort, "
                  "backup GEMMs, chunk map)"),
    ("bwd.wgrad_dy", "the first wgrad_kernel (DY pass)"),
    ("bwd.wgrad_x", "the second wgrad_kernel (X pass)"),
    ("bwd.dx", "dx_rows_kernel"),
    ("bwd.outputs", "launches after dx_rows_kernel (casts, dW_down's transpose, the op's bias-grad sum)"),
    ("bwd.fill_copy", "the backward's fills, memsets and copies"),
    ("kernels", "every launch of the step, summed"),
)
SCALE_PARTS = {
    "eager": (("step", "do_bench", "reference.ffn_dense through autograd: 3 cuBLAS GEMMs + relu*up forward, "
                                   "6 GEMMs backward"),),
    "inductor": (("step", "do_bench", "reference.ffn_dense under torch.compile (Inductor, dynamic=False) through "
                                      "autograd"),),
}


def classify_ours(phase: int, names: list[str]) -> list[str]:
    """Labels (OURS_KERNEL_PARTS) of the launches of one phase of our op's step: 0 the forward
    (ffn_train_forward, path 'twell'), 1 the backward (ffn_train_backward -> backward_sparse),
    in launch order. Fills, memsets and copies by name; our Triton kernels by name; the gate
    GEMM is what the forward launches before compact_rows_kernel; the backward's setup is what
    runs before its first wgrad_kernel, and what follows dx_rows_kernel is the outputs'."""
    out = []
    if phase == 0:
        packed = False
        for name in names:
            packed = packed or "compact_rows" in name
            out.append("fwd.fill_copy" if fill_or_copy(name) else "fwd.pack" if "compact_rows" in name
                       else "fwd.up_down" if ("train_fwd" in name or "transpose_kernel" in name)
                       else "fwd.stats" if "row_stats" in name
                       else "fwd.other" if packed else "fwd.gate_gemm")
        return out
    wgrad, dx_done = 0, False
    for name in names:
        if "wgrad_kernel" in name:
            wgrad += 1
            out.append("bwd.wgrad_dy" if wgrad == 1 else "bwd.wgrad_x")
        elif "dx_rows" in name:
            dx_done = True
            out.append("bwd.dx")
        elif fill_or_copy(name):
            out.append("bwd.fill_copy")
        else:
            out.append("bwd.outputs" if dx_done else "bwd.setup")
    return out


def part_rows(point: Mapping, impl: str, spec: Iterable[tuple], times: Mapping[str, float],
              skipped: Optional[str] = None, status: str = "ok", dev=None, **extra) -> list[dict]:
    """One stamped row per part of ``spec`` ((part, method, launches), or (part, launches) for the
    "kernels" method): ms from ``times`` (NaN, and the status saying why, where ``skipped`` or
    where ``times`` lacks the part). ``status``: the status of the measured rows (the
    reference's "crashed ..." gives NaN rows with it)."""
    rows = []
    for entry in spec:
        part, method, launches = entry if len(entry) == 3 else (entry[0], "kernels", entry[1])
        ms = NAN if skipped else float(times.get(part, NAN))
        why = f"skipped: {skipped}" if skipped else status if status != "ok" else (
            "ok" if math.isfinite(ms) else "missing: no figure for this part")
        rows.append(stamp(dict(point, impl=impl, part=part, method=method, ms=ms, launches=launches,
                               status=why, **extra), dev))
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a text table: one line per (impl, method, part), one column of ms per M."""
    ms_cols = sorted({r["M"] for r in rows})
    keys: list[tuple] = []
    for r in rows:
        key = (r["impl"], r["method"], r["part"])
        if key not in keys:
            keys.append(key)
    cell = {(r["impl"], r["method"], r["part"], r["M"]): r for r in rows}
    out = [f"{'impl':<9} {'method':<9} {'part':<17}" + "".join(f" {'M=' + str(m):>10}" for m in ms_cols)]
    for key in keys:
        line = f"{key[0]:<9} {key[1]:<9} {key[2]:<17}"
        for m in ms_cols:
            r = cell.get((*key, m))
            line += f" {'':>10}" if r is None else f" {r['ms']:>10.3f}" if r["status"] == "ok" else f" {'-':>10}"
        out.append(line)
    return "\n".join(out)


def host_clock(spec: Iterable[tuple]) -> tuple:
    """``spec`` with its do_bench parts relabelled "host_clock" (the CPU's timing.bench)."""
    return tuple((p, "host_clock" if meth == "do_bench" else meth, what) for p, meth, what in spec)


def time_variants(fns: Mapping[str, Callable[[], object]], reps: int, rounds: int, cuda: bool) -> dict[str, float]:
    """Interleaved medians (timing.interleaved_ms): do_bench on CUDA, the host clock
    (timing.bench, median of three calls after one) on the CPU."""
    if cuda:
        return interleaved_ms(fns, reps, rounds)
    return interleaved_ms({}, reps, rounds, timers={n: (lambda rep, f=f: bench(f, rep, False)) for n, f in fns.items()})


def point_rows(args, m: int, k: int, n: int, d: float, t: float, dev: torch.device, dt: torch.dtype) -> list[dict]:
    """Every row of one point: ours, eager, Inductor, then the paper's (child process)."""
    cuda = dev.type == "cuda"
    cfg = TwellConfig()
    seed = hash((m, k, n, d, t)) & 0xFFFF                   # bench_ffn_train.py's seed: the same inputs
    x, wg, wu, wd, dy = train_inputs(m, k, n, d, t, seed, dev, dt, args.activity)
    params = (x, wg, wu, wd)
    point = dict(M=m, K=k, N=n, density=d, tail=t, activity=args.activity, dtype=str(dt).replace("torch.", ""))
    xd, wgd, wdd = x.detach(), wg.detach(), wd.detach()
    wud = unit_rows(wu.detach())                            # as forward_sparse passes W_up on
    width, cap = min(cfg.ell_width, n), int(backup_capacity(m, cfg.backup_rows))
    kernels_here = cuda or INTERPRET
    rows: list[dict] = []
    fns: dict[str, Callable[[], object]] = {}
    extra: dict = {}
    if kernels_here:
        # the state each part starts from, made once by the same calls
        g = cuda_train.gate_gemm(xd, wgd, None)
        pk = cuda_train.pack_gate(g, width, cap, True)
        y, hsum, cnt, *state, missing = cuda_train.packed_forward(xd, g, None, pk, wud, None, wdd, None, True)
        extra["busy_rows"] = int((cnt > width).sum())
        with torch.no_grad():
            extra["nnz_per_row"] = float(cnt.float().mean())
        st = cuda_train.sparse_bwd_setup(dy, xd, wgd, None, wud, None, wdd, cnt, *state, 0.0)
        cuda_train.sparse_bwd_dy_pass(st)                   # eg, eu for the X pass and dx
        fwd_state = cuda_train.forward_sparse(xd, wgd, None, wud, None, wdd, None, width, cap)[2:-1]

        def dy_pass():
            st.tickets[:1].zero_()
            cuda_train.sparse_bwd_dy_pass(st)

        def x_pass():
            st.tickets[1:].zero_()
            cuda_train.sparse_bwd_x_pass(st)

        def fwd_bwd():
            s = cuda_train.forward_sparse(xd, wgd, None, wud, None, wdd, None, width, cap)[2:-1]
            return cuda_train.backward_sparse(dy, xd, wgd, None, wud, None, wdd, *s, 0.0)

        fns.update({
            "fwd.gate_gemm": lambda: cuda_train.gate_gemm(xd, wgd, None),
            "fwd.pack": lambda: cuda_train.pack_gate(g, width, cap, True),
            "fwd.stats": lambda: record_stats(None, cnt, hsum, n, lost=missing),
            "fwd.up_down": lambda: cuda_train.packed_forward(xd, g, None, pk, wud, None, wdd, None, True),
            "fwd": lambda: cuda_train.forward_sparse(xd, wgd, None, wud, None, wdd, None, width, cap),
            "bwd.setup": lambda: cuda_train.sparse_bwd_setup(dy, xd, wgd, None, wud, None, wdd, cnt, *state, 0.0),
            "bwd.wgrad_dy": dy_pass,
            "bwd.wgrad_x": x_pass,
            "bwd.dx": lambda: cuda_train.sparse_bwd_dx(st),
            "bwd.outputs": lambda: cuda_train.sparse_bwd_outputs(st),
            "bwd": lambda: cuda_train.backward_sparse(dy, xd, wgd, None, wud, None, wdd, *fwd_state, 0.0),
            "fwd+bwd": fwd_bwd,
        })
    layer = f"train_parts/{m}/{d}/{t}"

    def step(fn):
        return lambda: torch.autograd.grad(fn(x, wg, None, wu, None, wd, None), params, dy)

    def op(path):
        return lambda *a: torch.ops.twell.ffn_train(*a, cfg.ell_width, cfg.backup_rows, 0.0, f"{layer}/{path}",
                                                    False, path=path)[0]

    if cuda:
        fns["step.sparse"], fns["step.op"] = step(op("twell")), step(op("auto"))
    fns["eager.step"] = step(ffn_dense)
    inductor = torch.compile(ffn_dense, dynamic=False) if cuda and not args.no_inductor else None
    if inductor is not None:
        fns["inductor.step"] = step(inductor)
    for f in fns.values():                                  # compile, and let the op's density land
        for _ in range(3 if cuda else 1):                   # (the interpreter: one call compiles nothing)
            f()
    if cuda:
        torch.cuda.synchronize()
    got = time_variants(fns, args.reps, args.rounds, cuda)
    ours = {p: v for p, v in got.items() if not p.startswith(("eager.", "inductor."))}
    path = density.last_path(("train", f"{layer}/auto", x.device, x.dtype, k, n, k, True)) if cuda else None
    why_ours = None if kernels_here else "the Triton kernels need CUDA or TRITON_INTERPRET=1"
    why_op = None if cuda else "the op runs its CUDA kernels on CUDA tensors only (on the CPU it takes the torch path)"
    timed = (lambda spec: spec) if cuda else host_clock
    rows += part_rows(point, "ours", timed(OURS_PARTS[:12]), ours, why_ours, dev=dev, **extra)
    rows += part_rows(point, "ours", timed(OURS_PARTS[12:]), ours, why_op, dev=dev, path=path, **extra)
    rows += part_rows(point, "eager", timed(SCALE_PARTS["eager"]), {"step": got["eager.step"]}, dev=dev)
    rows += part_rows(point, "inductor", timed(SCALE_PARTS["inductor"]), {"step": got.get("inductor.step", NAN)},
                      None if inductor is not None else
                      "--no-inductor" if cuda else "--smoke: Inductor's CPU compile is not timed", dev=dev)
    # device time per part of the op's sparse step
    why_kernels = None if cuda and not args.no_kernels else "--no-kernels" if cuda else \
        "the profiler's breakdown times CUDA kernels"
    split: dict[str, float] = {}
    if why_kernels is None:
        sparse = op("twell")

        def marked():
            mark_phase()
            out = sparse(x, wg, None, wu, None, wd, None)
            mark_phase()
            torch.autograd.grad(out, params, dy)

        marked()
        split = kernel_parts(kernel_phases(marked, args.kernel_steps), 2, classify_ours)
        split["kernels"] = sum(split.values())
    rows += part_rows(point, "ours", OURS_KERNEL_PARTS, split, why_kernels, dev=dev, **extra)
    del fns, inductor
    if kernels_here:
        del g, pk, y, hsum, cnt, state, missing, st, fwd_state
    # the paper's, in a process of its own on the same inputs (the same seed)
    spec = reference.PAPER_PARTS + (() if args.no_kernels else reference.PAPER_KERNEL_PARTS)
    if not cuda:
        rows += part_rows(point, "paper", spec, {}, "the paper's kernels need CUDA (sm_90)", dev=dev)
    elif not args.reference:
        rows += part_rows(point, "paper", spec, {}, "no --reference DIR", dev=dev)
    else:
        torch.cuda.empty_cache()                            # the child shares this GPU
        res = reference.run_train_parts_point(args.reference, m, k, n, d, t, seed, args.reps, args.rounds,
                                              args.ref_timeout, not args.no_kernels, args.activity)
        got_ref = {(p["part"], p["method"]): p["ms"] for p in res["parts"]}
        for entry in spec:
            part, method = entry[0], entry[1] if len(entry) == 3 else "kernels"
            one = (entry,) if len(entry) == 3 else ((part, method, entry[1]),)
            rows += part_rows(point, "paper", one, {part: got_ref.get((part, method), NAN)},
                              status=res["ref_status"], dev=dev)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, nargs="+", default=None, help="tokens (default 16384 65536)")
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--tail", type=float, default=0.0)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--N", type=int, default=5632)
    ap.add_argument("--reps", type=int, default=300, help="do_bench ms per variant, split over the rounds")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--kernel-steps", type=int, default=5, help="steps under torch.profiler per point and side")
    ap.add_argument("--no-kernels", action="store_true", help="no torch.profiler breakdown")
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--reference", default=None, metavar="DIR",
                    help="the sparser-faster-llms folder (../shared/anchor/README.md): the paper's parts")
    ap.add_argument("--ref-timeout", type=float, default=240, help="seconds per reference point")
    ap.add_argument("--activity", default="iid", help="the inputs' activity (bench_ffn_train.py --activity)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, tiny shapes, fp16 (our parts under TRITON_INTERPRET=1, the rest skipped)")
    ap.add_argument("--out", default=None, help="JSON path (default runs/<gpu>/train_parts.json)")
    args = ap.parse_args(argv)
    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        ap.error("no CUDA device: --smoke runs the CPU smoke mode")
    if args.smoke:
        if args.reference:
            ap.error("--reference runs on CUDA: not with --smoke")
        ms, k, n, dt = args.M or [64], 64, 160, torch.float16   # the interpreter's bf16 tl.dot is broken
        args.rounds = 1
    else:
        ms, k, n, dt = args.M or [16384, 65536], args.K, args.N, torch.bfloat16
        torch.backends.cuda.matmul.allow_tf32 = False
    if args.reference:
        print(f"reference {args.reference}: {reference.build_train(args.reference)}", flush=True)
    dev = torch.device("cuda" if cuda else "cpu")
    out = out_path(args.out, gpu_name() if cuda else "cpu", "train_parts.json" if cuda else "train_parts_smoke.json")
    rows: list[dict] = []
    for m in ms:
        rows += point_rows(args, m, k, n, args.density, args.tail, dev, dt)
        write_json(out, rows)                               # after every point: partial runs keep theirs
        if cuda:
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    print(table(rows))
    print(f"wrote {out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
