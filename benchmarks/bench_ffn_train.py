"""FFN training step (forward + backward): dense eager vs Inductor vs twell::ffn_train, one run.

    python3 benchmarks/bench_ffn_train.py                  # the training grid (K=2048, N=5632)
    python3 benchmarks/bench_ffn_train.py --M 16384 --density 0.005 --tail 0
    python3 benchmarks/bench_ffn_train.py --quick          # CPU smoke test, tiny shapes
    python3 benchmarks/bench_ffn_train.py --act relu2 --M 16384 --density 0.005 --tail 0   # squared ReLU
    python3 benchmarks/bench_ffn_train.py --act drelu --M 16384 --density 0.005 --tail 0   # relu(gate) * relu(up)

Inputs: twell_compile/testing.py (anchors.md's generator), bf16, gated, no biases; dy random.
One step = y = FFN(x) and torch.autograd.grad(y, (x, W_g, W_u, W_d), dy). --act (rows: act):
the activation of every column (eager, Inductor, the op and its forced paths, the fp32
reference): relu, relu2 (relu(g)^2 * u) or drelu (relu(g) * relu(u)); nnz/r and busy% stay
relu(g)'s, the count the state's lists follow. Times are medians of
triton.testing.do_bench (CUDA events). twell_ms is the op as the backend calls it (the rules
included, after warm-up calls that let the layer's density land; ``path`` is the path its last
call took: "twell", "compact" or "dense"); sparse_ms, compact_ms and densepath_ms force its
paths (the op's path= argument: the sparse kernels; eager's GEMMs saving the compact state;
eager's GEMMs saving g and u). Sparse is not timed at density >= 0.05, where rows overflow any
ELL width, nor sparse and compact where the M tokens fit the dense backup (NaN). Peak memory =
max_memory_allocated during the step minus the allocation before it (inputs and weights
excluded, gradients included). grad_rel_err = max over the four gradients of ||g - g_fp32|| / ||g_fp32|| against
fp32 autograd (TF32 off); dense_grad_rel_err is eager bf16's. Rows as benchmarks/rows.py
stamps them (``config``: the record fields --config changed, "record" for none), to --out (default runs/<gpu>/ffn_training.json; the canonical file:
benchmarks/results/README.md).

--reference DIR (the sparser-faster-llms folder, ../shared/anchor/README.md) runs the paper's
training op (torch.ops.sparse_ops.ff_forward_gated, forward + backward) on each point's inputs
(``train_inputs``), in a process of its own (benchmarks/reference.py: it crashes on some
points): ref_ms (do_bench median), ref_mib (peak memory as above), ref_grad_rel_err (as
grad_rel_err; ref_grad_rel_errs per gradient: x, w_gate, w_up, w_down) and ref_status ("ok",
"crashed rc=..", "timeout"). The table adds ref, x_ref (dense_ms / ref_ms), r_MiB and ref_err,
"crash" / "timeout" in place of the figures of a point where the reference did not finish.

--activity PROFILE.json[:LAYER]: the inputs from a trained layer's activity profile
(benchmarks/activity_profile.py; testing.make_ffn_for) at its density, tail 0, each row's
``activity`` naming it; the reference's child builds the same. A checkpoint spec is refused:
its FFN has biases and this grid's has none.

--parts times each stage of the sparse path (forced) for a few launch configurations of the
training kernels (record fields, through arch.patched); --config runs the grid under one
(``field=value,...``, e.g. ``fwd_pairs=4,fwd_cols_per_warp=512``).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

if __package__ in (None, ""):                  # run as a file: python3 benchmarks/bench_ffn_train.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import reference  # noqa: E402
from benchmarks.rows import out_path, stamp, write_json  # noqa: E402
from benchmarks.timing import bench, gpu_name, peak_mib, rel, train_inputs  # noqa: E402

import twell_compile.ops  # noqa: E402,F401  (registers torch.ops.twell)
from twell_compile.config import TwellConfig  # noqa: E402
from twell_compile.formats import backup_capacity  # noqa: E402
from twell_compile.reference import ACTS, ffn_dense  # noqa: E402
from twell_compile.runtime import arch, density  # noqa: E402
from twell_compile.testing import load_activity_profile, make_ffn, parse_activity  # noqa: E402

FULL_M = [1024, 16384, 65536]
FULL_D = [0.005, 0.02, 0.05, 0.2, 1.0]
FULL_T = [0.0, 0.2]


def ref_cells(paper: dict, dense_ms: float) -> str:
    """The reference's columns of the table (REF_HDR): its status where it gave no figures."""
    if paper["ref_status"] != "ok":
        word = "timeout" if paper["ref_status"] == "timeout" else "crash"
        return f" {word:>7} {'':>6} {'':>7} {'':>8}"
    ms = paper["ref_ms"]
    return f" {ms:>7.3f} {dense_ms / ms:>6.2f} {paper['ref_mib']:>7.0f} {paper['ref_grad_rel_err']:>8.1e}"


REF_HDR = f" {'ref':>7} {'x_ref':>6} {'r_MiB':>7} {'ref_err':>8}"


# Launch configurations --parts compares (record fields; {} is the record's own): the wgrad
# passes at their probe optimum (DY 1 entry / 2 warps, X 2 / 2 at K=2048: 9% faster on this
# layer, 214.8 against 197.7 ms per step on bench_e2e.py --train; H200, 2026-11-23) and the
# forward row kernel at 4 pairs / 4 warps (682 against 531 us at 1 / 2).
PART_CONFIGS = ({}, dict(wg_dy_entries=1, wg_dy_cols_per_warp=1024, wg_x_entries=2, wg_x_warps=2),
                dict(fwd_pairs=4, fwd_cols_per_warp=512))


def parse_config(text: str) -> dict[str, Any]:
    """--config "field=value,..." as record fields (ints, else floats)."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--config takes field=value pairs (runtime/arch.py GpuPolicy), got {item!r}")
        out[name.strip()] = float(value) if "." in value or "e" in value.lower() else int(value)
    with arch.patched(**out):          # an unknown field raises here, naming the known ones
        pass
    return out


def config_name(c: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in c.items()) or "record"


def parts(ms, ds, ts, k, n, cfg, reps, act="relu") -> int:
    """Stage times of the sparse path (forced) for the launch configurations of PART_CONFIGS."""
    from twell_compile.runtime import cuda_train

    totals = [0.0] * len(PART_CONFIGS)
    print(f"{'M':>6} {'dens':>6} {'tail':>4} {'gate':>7} {'state':>7} {'fwd':>7} {'bwd':>7} {'total':>7} config",
          flush=True)
    for m in ms:
        for d in ds:
            for t in ts:
                p = make_ffn(m, k, n, d, t, device="cuda", seed=1)
                x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
                dy = torch.randn(m, k, device="cuda", dtype=x.dtype)
                w, cap = min(cfg.ell_width, n), int(backup_capacity(m, cfg.backup_rows))
                g = F.linear(x, wg)
                fwd = lambda: cuda_train.forward_sparse(x, wg, None, wu, None, wd, None, w, cap, act)
                _, _, *st, _ = fwd()
                bwd = lambda: cuda_train.backward_sparse(dy, x, wg, None, wu, None, wd, *st, 0.0, act)
                t_gate = bench(lambda: F.linear(x, wg), reps, True)
                for i, changes in enumerate(PART_CONFIGS):
                    with arch.patched(**changes):
                        t_state = bench(lambda: cuda_train.hybrid_state(x, g, None, wu, None, wd, None, w, cap, True,
                                                                  act), reps, True)
                        t_fwd = bench(fwd, reps, True)
                        t_bwd = bench(bwd, reps, True)
                    totals[i] += t_fwd + t_bwd
                    print(f"{m:>6} {d:>6} {t:>4} {t_gate:>7.3f} {t_state:>7.3f} {t_fwd:>7.3f} {t_bwd:>7.3f} "
                          f"{t_fwd + t_bwd:>7.3f} {config_name(changes)}", flush=True)
                # per-kernel device time of 10 steps, the record's configuration
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        _, _, *st2, _ = fwd()
                        bwd()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14), flush=True)
                del st2
                del p, x, wg, wu, wd, g, st
    best = min(range(len(PART_CONFIGS)), key=totals.__getitem__)
    print(f"best config (--config): {config_name(PART_CONFIGS[best])}", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, nargs="+", default=None)
    ap.add_argument("--density", type=float, nargs="+", default=None)
    ap.add_argument("--tail", type=float, nargs="+", default=None)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--N", type=int, default=5632)
    ap.add_argument("--quick", action="store_true", help="CPU smoke test on tiny shapes")
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--reps", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--parts", action="store_true",
                    help="instead of the grid: time each stage of the sparse path at each (M, density, tail)")
    ap.add_argument("--config", default=None,
                    help="launch fields of the GPU record for the grid, field=value,... (as --parts prints "
                         "them; default: the record's)")
    ap.add_argument("--reference", default=None, metavar="DIR",
                    help="the paper's kernels (the sparser-faster-llms folder, ../shared/anchor/README.md): "
                         "ref_ms / ref_mib / ref_grad_rel_err per point, each in a process of its own "
                         "(benchmarks/reference.py)")
    ap.add_argument("--ref-timeout", type=float, default=150, help="seconds per reference point")
    ap.add_argument("--activity", default="iid", metavar="iid|PROFILE.json[:LAYER]",
                    help="the inputs' activity: anchors.md's i.i.d. generator, or a trained layer's profile "
                         "(benchmarks/activity_profile.py; the grid's density then the profile's)")
    ap.add_argument("--act", choices=ACTS, default="relu",
                    help="the activation (rows: act): relu2 = relu(gate)**2 * up, drelu = relu(gate) * relu(up)")
    ap.add_argument("--out", default=None, help="JSON path (default runs/<gpu>/ffn_training.json)")
    args = ap.parse_args(argv)
    kind, path, layer = parse_activity(args.activity)
    if kind == "checkpoint":
        ap.error("--activity checkpoint:PATH: the training grid's FFN has no biases, a checkpoint's has; "
                 "give a profile (PROFILE.json[:LAYER]) or iid")
    if kind == "profile":
        if args.parts:
            ap.error("--activity runs on the grid: not with --parts")
        name, prof = load_activity_profile(path, layer)
        args.activity = f"{path}:{name}"
        args.density, args.tail = [float(f"{float(prof['density']):.4g}")], [0.0]
        print(f"activity: profile {args.activity} (density {args.density[0]:.4g})", flush=True)
    if args.reference:
        if args.quick or args.parts:
            ap.error("--reference runs on CUDA, on the grid: not with --quick or --parts")
        if args.act != "relu":
            ap.error("--reference: the paper's training op is ReLU-gated only: not with --act relu2 / drelu")
        # a folder without the reference raises ValueError here, naming the fix
        print(f"reference {args.reference}: {reference.build_train(args.reference)}", flush=True)
    cuda = not args.quick
    if args.quick:
        ms, ds, ts, k, n = [64], [0.05, 1.0], [0.0, 0.2], 64, 160
    else:
        ms, ds, ts, k, n = FULL_M, FULL_D, FULL_T, args.K, args.N
    ms, ds, ts = args.M or ms, args.density or ds, args.tail or ts
    dev = torch.device("cuda" if cuda else "cpu")
    dt = torch.bfloat16
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = TwellConfig()
    if args.parts:
        return parts(ms, ds, ts, k, n, cfg, args.reps, args.act)
    changes = parse_config(args.config) if args.config else {}
    if changes:
        print("launch config", config_name(changes))
    out = out_path(args.out, gpu_name() if cuda else "cpu", "ffn_training.json" if cuda else "ffn_training_quick.json")
    with arch.patched(**changes):
        rows = grid(args, ms, ds, ts, k, n, cfg, dev, dt, cuda, out)
    write_json(out, rows)
    print(f"wrote {out} ({len(rows)} rows)")
    return 0


def grid(args, ms, ds, ts, k, n, cfg, dev, dt, cuda, out) -> list[dict]:
    rows = []
    act = args.act
    launch = config_name(parse_config(args.config or ""))      # the rows' ``config``: record fields changed
    dense_fn = functools.partial(ffn_dense, act=act)
    hdr = (f"{'M':>6} {'dens':>6} {'tail':>4} {'nnz/r':>6} {'busy%':>5} {'dense':>7} {'induct':>7} {'twell':>7} "
           f"{'sparse':>7} {'compct':>7} {'dpath':>7} {'x_dns':>6} {'x_ind':>6} {'d_MiB':>7} {'t_MiB':>7} {'mem%':>5} "
           f"{'err':>8} {'d_err':>8}" + (REF_HDR if args.reference else "") + " path")
    print(hdr, flush=True)
    for m in ms:
        inductor = None if args.no_inductor or not cuda else torch.compile(dense_fn, dynamic=False)
        for d in ds:
            for t in ts:
                seed = hash((m, k, n, d, t)) & 0xFFFF
                x, wg, wu, wd, dy = train_inputs(m, k, n, d, t, seed, dev, dt, args.activity)
                params = (x, wg, wu, wd)
                layer = f"bench_train/{m}/{d}/{t}"

                def step(fn):
                    return lambda: torch.autograd.grad(fn(x, wg, None, wu, None, wd, None), params, dy)

                def op(name, path="auto"):
                    return lambda *a: torch.ops.twell.ffn_train(*a, cfg.ell_width, cfg.backup_rows, 0.0, name, False,
                                                                path=path, act=act)[0]

                dense = step(dense_fn)
                twell = step(op(layer))
                for _ in range(3):                       # let the layer's density land
                    twell()
                    if cuda:
                        torch.cuda.synchronize()
                dense_ms = bench(dense, args.reps, cuda)
                ind_ms = bench(step(inductor), args.reps, cuda) if inductor else float("nan")
                twell_ms = bench(twell, args.reps, cuda)
                path = "torch"
                forced_ms = dict(dense=float("nan"), compact=float("nan"), twell=float("nan"))
                if cuda:
                    path = density.last_path(("train", layer, x.device, x.dtype, k, n, k, True))
                    fits_backup = backup_capacity(m, cfg.backup_rows) >= m
                    for forced in forced_ms:
                        # the compact and sparse states need more tokens than dense-backup rows
                        if forced != "dense" and (fits_backup or (forced == "twell" and d >= 0.05)):
                            continue
                        f = step(op(f"{layer}/{forced}", forced))
                        for _ in range(3):
                            f()
                            torch.cuda.synchronize()
                        forced_ms[forced] = bench(f, args.reps, cuda)
                sparse_ms, compact_ms, dpath_ms = forced_ms["twell"], forced_ms["compact"], forced_ms["dense"]
                dense_peak = peak_mib(dense, cuda)
                twell_peak = peak_mib(twell, cuda)
                ind_peak = peak_mib(step(inductor), cuda) if inductor else float("nan")
                # accuracy: the four gradients against fp32 autograd
                ref = torch.autograd.grad(dense_fn(*(a.float() if a is not None else None
                                                     for a in (x, wg, None, wu, None, wd, None))),
                                          params, dy.float())
                got = twell()
                eag = dense()
                err = max(rel(a, r) for a, r in zip(got, ref))
                derr = max(rel(a, r) for a, r in zip(eag, ref))
                del ref, got, eag
                with torch.no_grad():
                    cnt = (F.linear(x, wg) > 0).sum(1)
                nnz = float(cnt.float().mean())
                busy = float((cnt > min(cfg.ell_width, n)).float().mean()) * 100
                paper = {}
                if args.reference:
                    if cuda:
                        torch.cuda.empty_cache()          # the child shares this GPU
                    paper = reference.run_train_point(args.reference, m, k, n, d, t, seed, args.reps,
                                                      args.ref_timeout, activity=args.activity)
                row = stamp(dict(M=m, K=k, N=n, density=d, tail=t, dense_ms=dense_ms, inductor_ms=ind_ms,
                                 twell_ms=twell_ms, sparse_ms=sparse_ms, compact_ms=compact_ms, densepath_ms=dpath_ms,
                                 dense_peak_mib=dense_peak, twell_peak_mib=twell_peak, inductor_peak_mib=ind_peak,
                                 grad_rel_err=err, dense_grad_rel_err=derr, nnz_per_row=nnz, busy_row_pct=busy,
                                 ell_width=cfg.ell_width, path=path, activity=args.activity, act=act,
                                 config=launch, **paper), dev)
                rows.append(row)
                write_json(out, rows)       # after every row: partial runs keep theirs
                print(f"{m:>6} {d:>6} {t:>4} {nnz:>6.1f} {busy:>5.1f} {dense_ms:>7.3f} {ind_ms:>7.3f} "
                      f"{twell_ms:>7.3f} {sparse_ms:>7.3f} {compact_ms:>7.3f} {dpath_ms:>7.3f} {dense_ms / twell_ms:>6.2f} "
                      f"{ind_ms / twell_ms:>6.2f} {dense_peak:>7.0f} {twell_peak:>7.0f} "
                      f"{100 * twell_peak / dense_peak if dense_peak == dense_peak else float('nan'):>5.0f} "
                      f"{err:>8.1e} {derr:>8.1e}" + (ref_cells(paper, dense_ms) if paper else "") + f" {path}"
                      + (f" [reference {paper['ref_status']}]" if paper and paper["ref_status"] != "ok" else "")
                      + ("  ERR>2x" if err > 2 * derr else ""), flush=True)
                del x, wg, wu, wd, params, dy, dense, twell
        del inductor
        torch._dynamo.reset()
    return rows


if __name__ == "__main__":
    sys.exit(main())
