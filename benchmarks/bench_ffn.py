"""FFN inference: dense eager vs Inductor vs the gate GEMM alone vs twell, in one run.

    python3 benchmarks/bench_ffn.py                      # the full grid
    python3 benchmarks/bench_ffn.py --quick              # K=2048 N=5632, M 16384/65536, 4 densities
    python3 benchmarks/bench_ffn.py --M 16384 --density 0.005 0.02 --tail 0 --shapes 2048x5632

    python3 benchmarks/bench_ffn.py --decode             # decode grid: M 1..64, CUDA graphs
    python3 benchmarks/bench_ffn.py --decode --M 64 128 256 512 2048 8192 --density 0.005 \
        --shapes 2048x5632 --out /tmp/crossover.json    # where dense starts to win

Inputs: twell_compile/testing.py (anchors.md's generator), bf16, under no_grad. Times are
medians of triton.testing.do_bench (CUDA events) taken in interleaved rounds (timing.py:
every variant once per round, --rounds rounds, the median round). twell_ms is the product: a
gated FFN module (3 nn.Linear) holding the point's weights, compiled with backend="twell"
(dynamic=False, --mode), so shapes the backend leaves to Inductor read Inductor's time and
``path`` says which ran ("inductor", or the path the product's own op last took); inductor_ms is the same module compiled
by Inductor, same mode (not ffn_dense compiled as a function taking the weights: its host time
differs from the module's, and at M <= 64 in the default mode both are host-bound, 0.06-0.18
ms per call, H200, 2026-11-24); op_ms is the op torch.ops.twell.ffn called directly on the
product's weights (the rules included: it may run dense); kernel_ms is the op with its per-row
TwELL path forced (path="twell"; list width from the measured non-zeros, as the rules pick it;
not timed above --kernel-max-density, where it is hopeless: NaN). rel_err is ||y - y_fp32|| /
||y_fp32|| against an fp32 reference (TF32 off) on up to 8192 rows; dense_rel_err is eager
bf16's on the same rows. "% floor" = gate_ms / twell_ms: the dense gate GEMM is the floor of
any TwELL FFN. Rows as benchmarks/rows.py stamps them, to --out (default
runs/<gpu>/ffn_inference.json; the canonical files: benchmarks/results/README.md).

--decode (benchmarks/bench_decode.py): dense eager vs the op (rules included) vs the op with
each decode form forced, each captured in a CUDA graph over several layers' weights (more
bytes than the L2 holds, as in a real model); default --out runs/<gpu>/ffn_decode.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):                  # run as a file: python3 benchmarks/bench_ffn.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_dynamic import FFN, OpCalls  # noqa: E402
from benchmarks import reference  # noqa: E402
from benchmarks.rows import out_path, stamp, write_json  # noqa: E402
from benchmarks.timing import gpu_name, interleaved_ms, rel  # noqa: E402

import twell_compile.ops  # noqa: E402,F401  (registers torch.ops.twell)
from twell_compile.reference import ffn_dense  # noqa: E402
from twell_compile.runtime import arch, decode_state, density, select  # noqa: E402
from twell_compile.testing import load_profile, make_ffn, make_ffn_profile  # noqa: E402

FULL_M = [1, 64, 1024, 16384, 65536]
FULL_D = [0.005, 0.01, 0.02, 0.05, 0.2, 1.0]
FULL_T = [0.0, 0.2]
FULL_S = ["2048x5632", "4096x11008"]
ERR_ROWS = 8192


def main(argv=None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    pre.add_argument("--decode", action="store_true")
    known, rest = pre.parse_known_args(argv)
    if known.decode:   # the decode grid (its own flags, see bench_decode.py)
        from benchmarks import bench_decode

        return bench_decode.main([a for a in (argv if argv is not None else sys.argv[1:]) if a != "--decode"])
    if known.device == "cpu":  # the CPU grid lives in bench_ffn_cpu.py (its own flags)
        from benchmarks import bench_ffn_cpu

        return bench_ffn_cpu.main(rest)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: run benchmarks/bench_ffn_cpu.py's grid with the remaining flags")
    ap.add_argument("--decode", action="store_true",
                    help="the decode grid (benchmarks/bench_decode.py) with the remaining flags")
    ap.add_argument("--M", type=int, nargs="+", default=None)
    ap.add_argument("--density", type=float, nargs="+", default=None)
    ap.add_argument("--tail", type=float, nargs="+", default=None)
    ap.add_argument("--shapes", nargs="+", default=None, help="KxN pairs, e.g. 2048x5632")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--reps", type=int, default=100, help="do_bench rep (ms) per variant, split over the rounds")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--mode", default="default", choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
                    help="torch.compile mode of the Inductor and twell modules")
    ap.add_argument("--kernel-max-density", type=float, default=0.1,
                    help="time the forced per-row path only up to this density")
    ap.add_argument("--nnz-profile", default=None,
                    help="replay a real non-zeros-per-token profile (train_sparse_lm.py --profile-out) "
                         "instead of the density/tail grid")
    ap.add_argument("--profile-layer", default=None, help="layer of the profile (default: the densest)")
    ap.add_argument("--reference", default=None, metavar="DIR",
                    help="the paper's kernels (the sparser-faster-llms folder, ../shared/anchor/README.md): "
                         "ref_ms / ref_rel_err per point, each in a process of its own (benchmarks/reference.py)")
    ap.add_argument("--ref-timeout", type=float, default=150, help="seconds per reference point")
    ap.add_argument("--out", default=None, help="JSON path (default runs/<gpu>/ffn_inference.json)")
    args = ap.parse_args(argv)
    if args.reference:
        print(f"reference {args.reference}: {reference.build(args.reference)}", flush=True)
    if args.quick:
        ms, ds, ts, shapes = [16384, 65536], [0.005, 0.02, 0.05, 1.0], [0.0, 0.2], ["2048x5632"]
    else:
        ms, ds, ts, shapes = FULL_M, FULL_D, FULL_T, FULL_S
    ms, ds, ts, shapes = args.M or ms, args.density or ds, args.tail or ts, args.shapes or shapes
    profile = layer_name = None
    if args.nnz_profile:
        layer_name, profile = load_profile(args.nnz_profile, args.profile_layer)
        ds, ts = [float(profile["density"])], [0.0]
        print(f"replaying {args.nnz_profile}:{layer_name} (density {ds[0]:.4g}, "
              f"mean {float(profile['mean']):.1f} of {profile['hidden']} non-zeros per token)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.config.cache_size_limit = 64
    dev = torch.device("cuda")
    rows = []
    out = out_path(args.out, gpu_name(), "ffn_inference.json")
    hdr = (f"{'M':>6} {'K':>5} {'N':>6} {'dens':>6} {'tail':>4} {'nnz/r':>6} {'W':>5} {'ovf%':>5} {'dense':>7} "
           f"{'induct':>7} {'gate':>7} {'twell':>7} {'op':>7} {'kernel':>7} {'x_ind':>6} {'x_op':>6} {'x_krn':>6} {'%floor':>6} "
           f"{'err':>8} {'d_err':>8} {'ref':>7} {'x_ref':>6} {'ref_err':>8} path")
    print(hdr, flush=True)
    torch.set_grad_enabled(False)       # inference: the backend rewrites to the inference op
    with OpCalls(cpu_rule=False) as op_calls:
        _grid(args, shapes, ms, ds, ts, profile, layer_name, dev, rows, out, op_calls)
    write_json(out, rows)
    print(f"wrote {out} ({len(rows)} rows)")
    return 0


def op_path(x, n: int, k_out: int, layer: str) -> str:
    """The path the op's next call on x takes for this layer (its rules and lagged density):
    "decode:<form>", "twell" or "dense"."""
    plan = select.plan_infer(x, n, k_out, True, layer, False)
    return f"decode:{plan.form}" if plan.path == "decode" else plan.path


def _grid(args, shapes, ms, ds, ts, profile, layer_name, dev, rows, out, op_calls) -> None:
    policy = arch.policy_for(dev)
    for shape in shapes:
        k, n = (int(v) for v in shape.split("x"))
        for m in ms:
            # the product and its baseline: one gated FFN module each, weights copied in per point
            tw_mod = FFN(k, n).to(dev, torch.bfloat16)
            ind_mod = FFN(k, n).to(dev, torch.bfloat16)
            inductor = None if args.no_inductor else torch.compile(ind_mod, dynamic=False, mode=args.mode)
            tw = torch.compile(tw_mod, backend="twell", dynamic=False, mode=args.mode)
            rewritten = None             # whether the backend rewrote this M's FFN (a compile-time fact)
            for d in ds:
                for t in ts:
                    seed = hash((m, k, n, d, t)) & 0xFFFF
                    p = (make_ffn_profile(m, k, n, profile, device=dev, seed=seed) if profile is not None
                         else make_ffn(m, k, n, d, t, device=dev, seed=seed))
                    x = p["x"]
                    for mod in (tw_mod, ind_mod):
                        mod.gate.weight.copy_(p["w_gate"])
                        mod.up.weight.copy_(p["w_up"])
                        mod.down.weight.copy_(p["w_down"])
                    # the op and the kernels read the product's weights (rewritten in place here,
                    # so CUDA graphs captured at the first point read this point's weights)
                    wg, wu, wd = tw_mod.gate.weight, tw_mod.up.weight, tw_mod.down.weight
                    args7 = (x, wg, None, wu, None, wd, None)
                    layer = f"bench/{m}/{k}/{n}/{d}/{t}"
                    op = lambda: torch.ops.twell.ffn(*args7, layer, False)
                    density.reset()              # no density measured on the previous point's weights
                    before = op_calls.n
                    tw(x)                        # compiles on the first point of this M
                    if rewritten is None:        # later points may replay CUDA graphs: no Python op call
                        rewritten = op_calls.n > before
                    ran_op = rewritten
                    for _ in range(20):          # the policy's first measurement lands
                        tw(x)
                    torch.cuda.synchronize()
                    # the product's own op instance's path (reset above: only its state is there)
                    tw_paths = sorted({path for inst, _, _, path in density.snapshot() if inst != 0 and path})
                    nnz = float((F.linear(x, wg) > 0).sum()) / m
                    width = select.list_width(policy, n, nnz)
                    # the forced per-row path reads its list width from the layer's measurement:
                    # this point's, landed up front (the op's rules would measure it the same)
                    klayer = f"{layer}/twell"
                    density.landed((klayer, x.device, x.dtype, k, n, k, True), nnz / n)
                    kern = lambda: torch.ops.twell.ffn(*args7, klayer, False, path="twell")
                    fns = dict(dense=lambda: ffn_dense(*args7), gate=lambda: F.linear(x, wg), op=op,
                               twell=lambda: tw(x))
                    if inductor is not None:
                        fns["inductor"] = lambda: inductor(x)
                    if d <= args.kernel_max_density:
                        fns["kernel"] = kern
                    t_ms = interleaved_ms(fns, args.reps, args.rounds)
                    nan = float("nan")
                    dense_ms, gate_ms, op_ms, twell_ms = t_ms["dense"], t_ms["gate"], t_ms["op"], t_ms["twell"]
                    ind_ms, kernel_ms = t_ms.get("inductor", nan), t_ms.get("kernel", nan)
                    # accuracy on up to ERR_ROWS rows, fresh outputs
                    r = min(m, ERR_ROWS)
                    y_op = op()[:r]
                    y_tw = tw(x)[:r]
                    xr = x[:r]
                    y_k = torch.ops.twell.ffn(xr, *args7[1:], klayer, False, path="twell")
                    ref = ffn_dense(*(a[:r].float() if i == 0 else (None if a is None else a.float())
                                      for i, a in enumerate(args7)))
                    err = rel(y_tw, ref)
                    op_err = rel(y_op, ref)
                    kerr = rel(y_k, ref)
                    derr = rel(ffn_dense(*args7)[:r], ref)
                    counts = (F.linear(xr, wg) > 0).sum(1)
                    ovf = float((counts > width).float().mean()) * 100     # rows over the list width
                    op_ran = op_path(x, n, k, layer)
                    paper = (reference.run_point(args.reference, m, k, n, d, t, seed, args.reps, args.rounds,
                                                 args.ref_timeout)
                             if args.reference and profile is None else {})
                    path = ("/".join(tw_paths) or op_ran) if ran_op else "inductor"
                    row = stamp(dict(M=m, K=k, N=n, density=d, tail=t, dense_ms=dense_ms, inductor_ms=ind_ms,
                                     gate_ms=gate_ms, twell_ms=twell_ms, rel_err=err, dense_rel_err=derr,
                                     op_ms=op_ms, op_rel_err=op_err, op_path=op_ran, mode=args.mode,
                                     kernel_ms=kernel_ms, kernel_rel_err=kerr, nnz_per_row=nnz,
                                     list_width=width, overflow_row_pct=ovf, path=path,
                                     profile=f"{args.nnz_profile}:{layer_name}" if profile is not None else None,
                                     **paper),
                                dev)
                    rows.append(row)
                    write_json(out, rows)     # every row: a timeout keeps the done ones
                    base = ind_ms if ind_ms == ind_ms else dense_ms
                    ref_ms, ref_err = paper.get("ref_ms", nan), paper.get("ref_rel_err", nan)
                    print(f"{m:>6} {k:>5} {n:>6} {d:>6} {t:>4} {nnz:>6.1f} {width:>5} {ovf:>5.2f} {dense_ms:>7.3f} "
                          f"{ind_ms:>7.3f} {gate_ms:>7.3f} {twell_ms:>7.3f} {op_ms:>7.3f} {kernel_ms:>7.3f} "
                          f"{base / twell_ms:>6.2f} {base / op_ms:>6.2f} {base / kernel_ms:>6.2f} "
                          f"{100 * gate_ms / twell_ms:>5.0f}% {err:>8.1e} {derr:>8.1e} "
                          f"{ref_ms:>7.3f} {base / ref_ms:>6.2f} {ref_err:>8.1e} {path}"
                          + (f" (op {op_ran})" if path != op_ran else "")
                          + (f" [reference {paper['ref_status']}]" if paper and paper["ref_status"] != "ok" else "")
                          + ("  ERR>2x" if max(err, op_err) > 2 * derr else "")
                          + ("  SLOW<0.97x" if base / twell_ms < 0.97 else ""), flush=True)
                    del p, x, wg, wu, wd, args7
            del inductor, tw, tw_mod, ind_mod
            torch._dynamo.reset()
            decode_state.clear()


if __name__ == "__main__":
    sys.exit(main())
