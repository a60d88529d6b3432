"""FFN training step (forward + backward): dense eager vs Inductor vs twell::ffn_train, one run.

    python3 benchmarks/bench_ffn_train.py                  # the grid of issue 4 (K=2048, N=5632)
    python3 benchmarks/bench_ffn_train.py --M 16384 --density 0.005 --tail 0
    python3 benchmarks/bench_ffn_train.py --quick          # CPU smoke test, tiny shapes

Inputs: twell_compile/testing.py (anchors.md's generator), bf16, gated, no biases; dy random.
One step = y = FFN(x) and torch.autograd.grad(y, (x, W_g, W_u, W_d), dy). Times are medians of
triton.testing.do_bench (CUDA events). twell_ms is the op as the backend calls it (policy
included, after warm-up calls that let the layer's density land); sparse_ms and densepath_ms
force its sparse kernels / its dense recompute path (sparse not timed at density >= 0.05,
where rows overflow any ELL width: NaN). Peak memory = max_memory_allocated during the step
minus the allocation before it (inputs and weights excluded, gradients included).
grad_rel_err = max over the four gradients of ||g - g_fp32|| / ||g_fp32|| against fp32
autograd (TF32 off); dense_grad_rel_err is eager bf16's. Writes
benchmarks/results/<gpu>/ffn_training.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from twell_compile.testing import make_ffn  # noqa: E402
from timing import gpu_name, median_ms, rel  # noqa: E402

import twell_compile.ops  # noqa: E402,F401  (registers torch.ops.twell)
from twell_compile.config import TwellConfig  # noqa: E402
from twell_compile.reference import ffn_dense  # noqa: E402

FULL_M = [1024, 16384, 65536]
FULL_D = [0.005, 0.02, 0.05, 0.2, 1.0]
FULL_T = [0.0, 0.2]


def bench(fn, reps: int, cuda: bool) -> float:
    if cuda:
        return median_ms(fn, reps)
    fn()
    t = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return sorted(t)[1] * 1e3


def peak_mib(fn, cuda: bool) -> float:
    if not cuda:
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def parts(ms, ds, ts, k, n, cfg, reps) -> int:
    """Stage times of the sparse path (forced) for a few kernel configurations."""
    from twell_compile.kernels import cuda_train
    from twell_compile.kernels.torch_impl import backup_capacity

    # current, then the wgrad passes at session 15's probe optimum (DY 1 entry / 2 warps, X 2 / 2,
    # faster on this layer, slower on bench_e2e --train) and the forward row kernel at 4 / 4
    configs = [current_config(cuda_train), (0, 1, 2, 2, 2048, 4, 1, 1024), (0, 4, 4, 4, 2048, 4, 4, 512)]
    totals = {c: 0.0 for c in configs}
    print(f"{'M':>6} {'dens':>6} {'tail':>4} {'config':>14} {'gate':>7} {'state':>7} {'fwd':>7} {'bwd':>7} "
          f"{'total':>7}", flush=True)
    for m in ms:
        for d in ds:
            for t in ts:
                p = make_ffn(m, k, n, d, t, device="cuda", seed=1)
                x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
                dy = torch.randn(m, k, device="cuda", dtype=x.dtype)
                w, cap = min(cfg.ell_width, n), int(backup_capacity(m, cfg.backup_rows))
                g = F.linear(x, wg)
                fwd = lambda: cuda_train.forward_sparse(x, wg, None, wu, None, wd, None, w, cap)
                _, _, *st, _ = fwd()
                bwd = lambda: cuda_train.backward_sparse(dy, x, wg, None, wu, None, wd, *st, 0.0)
                t_gate = bench(lambda: F.linear(x, wg), reps, True)
                default = current_config(cuda_train)
                for cfg_ in configs:
                    set_config(cuda_train, cfg_)
                    t_state = bench(lambda: cuda_train._state(x, g, None, wu, None, wd, None, w, cap, True), reps, True)
                    t_fwd = bench(fwd, reps, True)
                    t_bwd = bench(bwd, reps, True)
                    totals[cfg_] += t_fwd + t_bwd
                    print(f"{m:>6} {d:>6} {t:>4} {','.join(map(str, cfg_)):>14} {t_gate:>7.3f} {t_state:>7.3f} "
                          f"{t_fwd:>7.3f} {t_bwd:>7.3f} {t_fwd + t_bwd:>7.3f}", flush=True)
                set_config(cuda_train, default)
                # per-kernel device time of 10 steps, default configuration
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        _, _, *st2, _ = fwd()
                        bwd()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14), flush=True)
                del st2
                del p, x, wg, wu, wd, g, st
    best = min(totals, key=totals.get)
    print("config: forward-row-kernel warps (0: by width), its pairs per step, X-pass warps, X-pass entries "
          "per step, X-pass K chunk, dx pairs per step, DY-pass entries per step, DY-pass columns per warp")
    print("best config " + ",".join(map(str, best)), flush=True)
    return 0


def current_config(ct) -> tuple:
    return (ct.FWD_WARPS, ct.FWD_PAIRS, ct.WG_X_WARPS, ct.WG_X_ENTRIES, ct.WG_BK, ct.DX_PAIRS, ct.WG_DY_ENTRIES,
            ct.WG_DY_COLS_PER_WARP)


def set_config(ct, c) -> None:
    """c = (forward-row-kernel warps (0: by width), its pairs per step, X-pass warps, X-pass entries,
    X-pass K chunk[, dx pairs[, DY-pass entries, DY-pass columns per warp]])."""
    ct.FWD_WARPS = c[0]
    ct.FWD_PAIRS, ct.WG_X_WARPS, ct.WG_X_ENTRIES, ct.WG_BK = c[1:5]
    if len(c) > 5:
        ct.DX_PAIRS = c[5]
    if len(c) > 6:
        ct.WG_DY_ENTRIES, ct.WG_DY_COLS_PER_WARP = c[6:8]


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
                    help="kernel constants for the grid: warps,pairs,wgrad_warps,wgrad_entries,wgrad_k[,dx_pairs] "
                         "(as --parts prints them; default: cuda_train's)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<gpu>/ffn_training.json)")
    args = ap.parse_args(argv)
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
    if cuda:
        from twell_compile.kernels import cuda_train
    if args.parts:
        return parts(ms, ds, ts, k, n, cfg, args.reps)
    if args.config:
        from twell_compile.kernels import cuda_train as ct
        set_config(ct, tuple(int(v) for v in args.config.split(",")))
        print("kernel config", current_config(ct))
    if args.out:
        out = Path(args.out)
    elif cuda:
        out = Path(__file__).resolve().parent / "results" / gpu_name() / "ffn_training.json"
    else:
        out = Path("/tmp/ffn_training_quick.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    hdr = (f"{'M':>6} {'dens':>6} {'tail':>4} {'nnz/r':>6} {'busy%':>5} {'dense':>7} {'induct':>7} {'twell':>7} "
           f"{'sparse':>7} {'dpath':>7} {'x_dns':>6} {'x_ind':>6} {'d_MiB':>7} {'t_MiB':>7} {'mem%':>5} "
           f"{'err':>8} {'d_err':>8} path")
    print(hdr, flush=True)
    for m in ms:
        inductor = None if args.no_inductor or not cuda else torch.compile(ffn_dense, dynamic=False)
        for d in ds:
            for t in ts:
                seed = hash((m, k, n, d, t)) & 0xFFFF
                p = make_ffn(m, k, n, d, t, device=dev, seed=seed, dtype=dt)
                x, wg, wu, wd = (p[a].requires_grad_() for a in ("x", "w_gate", "w_up", "w_down"))
                params = (x, wg, wu, wd)
                dy = torch.randn(m, k, device=dev, dtype=torch.float32,
                                 generator=torch.Generator(dev).manual_seed(seed + 1)).to(dt)
                layer = f"bench_train/{m}/{d}/{t}"

                def step(fn):
                    return lambda: torch.autograd.grad(fn(x, wg, None, wu, None, wd, None), params, dy)

                def op(name):
                    return lambda *a: torch.ops.twell.ffn_train(*a, cfg.ell_width, cfg.backup_rows, 0.0, name, False)[0]

                dense = step(ffn_dense)
                twell = step(op(layer))
                for _ in range(3):                       # let the layer's density land
                    twell()
                    if cuda:
                        torch.cuda.synchronize()
                dense_ms = bench(dense, args.reps, cuda)
                ind_ms = bench(step(inductor), args.reps, cuda) if inductor else float("nan")
                twell_ms = bench(twell, args.reps, cuda)
                path = "?"
                sparse_ms = dpath_ms = float("nan")
                if cuda:
                    key = ("train", layer, x.device, x.dtype, k, n, k, True)
                    path = "sparse" if cuda_train.last_sparse.get(key) else "dense"
                    saved = cuda_train.SPARSE_MAX_DENSITY
                    try:
                        for forced, limit in (("dense", -1.0), ("sparse", float("inf"))):
                            if forced == "sparse" and (d >= 0.05 or m < cuda_train.MIN_TOKENS):
                                continue
                            cuda_train.SPARSE_MAX_DENSITY = limit
                            f = step(op(f"{layer}/{forced}"))
                            for _ in range(3):
                                f()
                                torch.cuda.synchronize()
                            ms_ = bench(f, args.reps, cuda)
                            if forced == "dense":
                                dpath_ms = ms_
                            else:
                                sparse_ms = ms_
                    finally:
                        cuda_train.SPARSE_MAX_DENSITY = saved
                dense_peak = peak_mib(dense, cuda)
                twell_peak = peak_mib(twell, cuda)
                ind_peak = peak_mib(step(inductor), cuda) if inductor else float("nan")
                # accuracy: the four gradients against fp32 autograd
                ref = torch.autograd.grad(ffn_dense(*(a.float() if a is not None else None
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
                row = dict(M=m, K=k, N=n, density=d, tail=t, dense_ms=dense_ms, inductor_ms=ind_ms,
                           twell_ms=twell_ms, sparse_ms=sparse_ms, densepath_ms=dpath_ms,
                           dense_peak_mib=dense_peak, twell_peak_mib=twell_peak, inductor_peak_mib=ind_peak,
                           grad_rel_err=err, dense_grad_rel_err=derr, nnz_per_row=nnz, busy_row_pct=busy,
                           ell_width=cfg.ell_width, path=path,
                           gpu=torch.cuda.get_device_name() if cuda else "cpu")
                rows.append(row)
                out.write_text(json.dumps(rows, indent=1))       # after every row: partial runs keep theirs
                print(f"{m:>6} {d:>6} {t:>4} {nnz:>6.1f} {busy:>5.1f} {dense_ms:>7.3f} {ind_ms:>7.3f} "
                      f"{twell_ms:>7.3f} {sparse_ms:>7.3f} {dpath_ms:>7.3f} {dense_ms / twell_ms:>6.2f} "
                      f"{ind_ms / twell_ms:>6.2f} {dense_peak:>7.0f} {twell_peak:>7.0f} "
                      f"{100 * twell_peak / dense_peak if dense_peak == dense_peak else float('nan'):>5.0f} "
                      f"{err:>8.1e} {derr:>8.1e} {path}" + ("  ERR>2x" if err > 2 * derr else ""), flush=True)
                del p, x, wg, wu, wd, params, dy, dense, twell
        del inductor
        torch._dynamo.reset()
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
