"""How fast can a row-gathering sparse FFN be at all? Floors measured on the device, one run.

    python3 benchmarks/probes/bench_floor.py             # the speed targets' points
    python3 benchmarks/probes/bench_floor.py --M 16384 --density 0.005 --tail 0

Every sparse kernel of this project (and the paper's) works per active (token m, neuron n)
pair and, with no weight row reused across tokens, moves whole 2*K-byte rows per pair:
  inference: W_up[n] and W_down^T[n] to token m (8 KB at K=2048);
  training: the same in the forward, then W_gate[n] and W_up[n] to m for dx, and x[m] and
            dy[m] to neuron n for dW_gate, dW_up, dW_down and dh (24 KB per pair in all).
With the anchors' generator every (m, n) fires independently, so tokens share almost no active
neurons: a block of B tokens reuses a loaded row B d / (1 - (1 - d)^B) times, 1.35 at B=128 and
d=0.005; reuse 2 needs B ~ 320, whose x and fp32 y rows (3.9 MB) exceed a 16-SM cluster's 3.6 MB
of shared memory.

This script times the sum of those rows and nothing else (``gather_probe.cu`` beside it: no dot
products, no dependency between rows, the best of 9 launch configurations) on the point's own
sparsity pattern, next to cuBLAS's gate GEMM, Inductor's dense FFN and eager's training step:
  infer_floor = gate + W_up/W_down^T rows per pair          (omits compaction, dots, x and y)
  train_floor = gate + sum over the four row groups of min(gathering it, its two dense GEMMs)
and prints the best ratio any such kernel could reach against the issue's target. Times are
medians of interleaved do_bench rounds (timing.interleaved_ms). Rows as benchmarks/rows.py
stamps them, to --out (default runs/<gpu>/floor.json; the canonical files:
benchmarks/results/README.md). The probe is built on first use from this folder
(twell_compile.build.load(..., directory=build.PROBES)); it ships with nothing.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):                  # run as a file: python3 benchmarks/probes/bench_floor.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.rows import out_path, stamp, write_json  # noqa: E402
from benchmarks.timing import gpu_name, interleaved_ms, median_ms  # noqa: E402

from twell_compile.reference import ffn_dense  # noqa: E402
from twell_compile.testing import make_ffn  # noqa: E402

# (M, density, tail): the inference and training targets' points, and their tail-0 neighbour
POINTS = [(16384, 0.005, 0.0), (16384, 0.02, 0.0), (16384, 0.05, 0.0), (65536, 0.005, 0.0), (65536, 0.005, 0.2)]
TARGETS = {  # (M, density, tail): (inference x Inductor, training x eager)
    (16384, 0.005, 0.0): (2.2, 2.2), (16384, 0.02, 0.0): (1.5, 1.4), (16384, 0.05, 0.0): (1.05, None),
    (65536, 0.005, 0.2): (1.8, 1.5), (65536, 0.005, 0.0): (None, None)}
CONFIGS = list(itertools.product((64, 128, 256), (2, 4, 8)))   # threads per row, rows in flight


def csr(active: torch.Tensor, shuffle: bool = False, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets [R + 1], column indices) of a boolean [R, C]; columns ascending per row, or in a
    random order within each row (``shuffle``)."""
    rows, cols = active.nonzero(as_tuple=True)
    if shuffle:
        g = torch.Generator(device=active.device).manual_seed(seed)
        key = rows.double() + torch.rand(rows.shape, generator=g, device=active.device, dtype=torch.float64) * 0.5
        order = key.argsort()
        cols = cols[order]
    counts = torch.bincount(rows, minlength=active.shape[0])
    off = torch.zeros(active.shape[0] + 1, dtype=torch.int32, device=active.device)
    off[1:] = counts.cumsum(0)
    return off, cols.to(torch.int32).contiguous()


def best_gather(ext, a, b, off, idx, out, reps: int) -> tuple[float, tuple[int, int]]:
    """(ms, (threads per row, rows in flight)) of the fastest configuration."""
    empty = a.new_empty(0)
    stream = torch.cuda.current_stream().cuda_stream
    best = None
    for tpr, unroll in CONFIGS:
        if (a.shape[1] // 8) % tpr or (a.shape[1] // 8) // tpr > 4:
            continue
        fn = lambda: ext.gather_sum(a, empty if b is None else b, off, idx, out, tpr, unroll, stream)
        ms = median_ms(fn, reps)
        if best is None or ms < best[0]:
            best = (ms, (tpr, unroll))
    return best


def check_gather(ext, a, b, off, idx, config: tuple[int, int]) -> float:
    """Relative error of the probe's sums (launched with the timed ``config``) on its first 64
    rows against torch (it must be exact to bf16 rounding, or the times mean nothing)."""
    t = min(64, off.numel() - 1)
    o, ix = off[:t + 1].clone(), idx[:int(off[t])]
    out = torch.full((t, a.shape[1]), float("nan"), dtype=a.dtype, device=a.device)
    ext.gather_sum(a, a.new_empty(0) if b is None else b, o, ix, out, *config, torch.cuda.current_stream().cuda_stream)
    rows = torch.repeat_interleave(torch.arange(t, device=a.device), (o[1:] - o[:-1]).long())
    ref = torch.zeros(t, a.shape[1], dtype=torch.float32, device=a.device)
    src = a[ix.long()].float() + (0 if b is None else b[ix.long()].float())
    ref.index_add_(0, rows, src)
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def train_step(x, wg, wu, wd, dy):
    y = ffn_dense(x, wg, None, wu, None, wd, None)
    return torch.autograd.grad(y, (x, wg, wu, wd), dy)


def point(ext, m, k, n, d, tail, reps, rounds, inductor) -> dict:
    dev = torch.device("cuda")
    p = make_ffn(m, k, n, d, tail, device=dev, seed=hash((m, k, n, d, tail)) & 0xFFFF)
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    wdt = wd.t().contiguous()
    dy = torch.randn(m, k, device=dev, dtype=x.dtype)
    with torch.no_grad():
        active = F.linear(x, wg) > 0
    pairs = int(active.sum())
    off_r, idx_r = csr(active)                        # per token: its neurons
    off_c, idx_c = csr(active.t())                    # per neuron: its tokens, ascending
    off_s, idx_s = csr(active.t(), shuffle=True)      # per neuron, random order
    del active
    y_rows = torch.empty(m, k, dtype=x.dtype, device=dev)
    y_cols = torch.empty(n, k, dtype=x.dtype, device=dev)
    sweep = max(10, reps // 4)
    pair = best_gather(ext, wu, wdt, off_r, idx_r, y_rows, sweep)
    col = best_gather(ext, x, None, off_c, idx_c, y_cols, sweep)
    col_s = best_gather(ext, x, None, off_s, idx_s, y_cols, sweep)
    col2 = best_gather(ext, x, dy, off_c, idx_c, y_cols, sweep)      # x and dy rows in one pass
    errs = [check_gather(ext, wu, wdt, off_r, idx_r, pair[1]), check_gather(ext, x, None, off_c, idx_c, col[1]),
            check_gather(ext, x, None, off_s, idx_s, col_s[1]), check_gather(ext, x, dy, off_c, idx_c, col2[1])]
    stream = torch.cuda.current_stream().cuda_stream
    empty = x.new_empty(0)
    xr = x.detach().requires_grad_()
    ws = [w.detach().requires_grad_() for w in (wg, wu, wd)]
    dh_t = torch.randn(m, n, device=dev, dtype=x.dtype)       # GEMM shapes of the backward
    fns = {
        "gate": lambda: F.linear(x, wg),
        "gemm_dx": lambda: dh_t @ wg,                            # [M, N] x [N, K]
        "gemm_wgrad": lambda: dh_t.t() @ x,                      # [N, M] x [M, K]
        "pairs": lambda: ext.gather_sum(wu, wdt, off_r, idx_r, y_rows, *pair[1], stream),
        "cols": lambda: ext.gather_sum(x, empty, off_c, idx_c, y_cols, *col[1], stream),
        "cols_shuffled": lambda: ext.gather_sum(x, empty, off_s, idx_s, y_cols, *col_s[1], stream),
        "cols_x_dy": lambda: ext.gather_sum(x, dy, off_c, idx_c, y_cols, *col2[1], stream),
        "eager_ffn": lambda: ffn_dense(x, wg, None, wu, None, wd, None),
        "eager_train": lambda: train_step(xr, *ws, dy),
    }
    if inductor is not None:
        fns["inductor_ffn"] = lambda: inductor(x, wg, None, wu, None, wd, None)
    with torch.no_grad():
        t = interleaved_ms({kk: v for kk, v in fns.items() if kk != "eager_train"}, reps, rounds)
    t.update(interleaved_ms({"eager_train": fns["eager_train"]}, reps, rounds))
    ti, tt = TARGETS.get((m, d, tail), (None, None))
    return stamp(dict(M=m, K=k, N=n, density=d, tail=tail, pairs=pairs, nnz_per_row=pairs / m, times_ms=t,
                      configs=dict(pairs=pair[1], cols=col[1], cols_shuffled=col_s[1], cols_x_dy=col2[1]),
                      probe_rel_err=max(errs), **floors(t, pairs, 2 * k * x.element_size()), infer_target=ti,
                      train_target=tt), dev)


def floors(t: dict, pairs: int, row_bytes: int) -> dict:
    """The floors from one point's times (ms; keys as in ``point``): ``row_bytes`` is the two
    rows moved per pair (4 * K bytes in bf16)."""
    gemm_fwd = 2 * t["gate"]                          # up + down, dense
    dense_ind = t.get("inductor_ffn", t["eager_ffn"])
    infer_floor = t["gate"] + t["pairs"]
    cols_best = min(t["cols"], t["cols_shuffled"])
    # the four row groups of a training step, each gathered or done as its two dense GEMMs
    groups = {"forward (W_up, W_down^T rows)": (t["pairs"], gemm_fwd),
              "dx (W_gate, W_up rows)": (t["pairs"], 2 * t["gemm_dx"]),
              "dW_gate, dW_up (x rows)": (cols_best, 2 * t["gemm_wgrad"]),
              "dh, dW_down (dy rows)": (cols_best, t["gemm_dx"] + t["gemm_wgrad"])}
    train_floor = t["gate"] + sum(min(g, dn) for g, dn in groups.values())
    tb = lambda nbytes, ms: nbytes / ms / 1e9
    return dict(
        pair_gather_tb_s=tb(pairs * row_bytes, t["pairs"]), col_gather_tb_s=tb(pairs * row_bytes / 2, t["cols"]),
        col_shuffled_tb_s=tb(pairs * row_bytes / 2, t["cols_shuffled"]),
        col_x_dy_tb_s=tb(pairs * row_bytes, t["cols_x_dy"]),
        infer_floor_ms=infer_floor, infer_dense_ms=dense_ind, infer_max_ratio=dense_ind / infer_floor,
        train_floor_ms=train_floor, train_floor_sparse_ms=t["gate"] + sum(g for g, _ in groups.values()),
        train_eager_ms=t["eager_train"], train_max_ratio=t["eager_train"] / train_floor,
        train_groups={kk: dict(gather_ms=g, dense_ms=dn) for kk, (g, dn) in groups.items()})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, nargs="+", default=None)
    ap.add_argument("--density", type=float, nargs="+", default=None)
    ap.add_argument("--tail", type=float, nargs="+", default=None)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--N", type=int, default=5632)
    ap.add_argument("--reps", type=int, default=100, help="do_bench ms per variant, split over the rounds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default runs/<gpu>/floor.json)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_floor.py needs a CUDA device")
    points = POINTS
    if a.M or a.density or a.tail:
        points = [(m, d, t) for m in (a.M or [16384]) for d in (a.density or [0.005]) for t in (a.tail or [0.0])]
    from twell_compile.build import load

    ext = load("gather_probe", directory=Path(__file__).resolve().parent)
    torch.backends.cuda.matmul.allow_tf32 = False
    out = out_path(a.out, gpu_name(), "floor.json")
    rows = []
    print(f"{'M':>6} {'dens':>6} {'tail':>4} {'nnz/r':>6} {'gate':>6} {'pairs':>6} {'TB/s':>5} {'cols':>6} "
          f"{'TB/s':>5} {'shuf':>6} {'x+dy':>6} {'ind':>6} {'floor':>6} {'max x':>6} {'tgt':>5} "
          f"{'eager_t':>7} {'t_floor':>7} {'max x':>6} {'tgt':>5}", flush=True)
    for m in sorted({p[0] for p in points}):
        inductor = None if a.no_inductor else torch.compile(ffn_dense, dynamic=False)
        for mm, d, tail in points:
            if mm != m:
                continue
            r = point(ext, m, a.K, a.N, d, tail, a.reps, a.rounds, inductor)
            rows.append(r)
            write_json(out, rows)
            t = r["times_ms"]
            fmt = lambda v: "-" if v is None else f"{v:.2f}"
            print(f"{m:>6} {d:>6} {tail:>4} {r['nnz_per_row']:>6.1f} {t['gate']:>6.3f} {t['pairs']:>6.3f} "
                  f"{r['pair_gather_tb_s']:>5.2f} {t['cols']:>6.3f} {r['col_gather_tb_s']:>5.2f} "
                  f"{t['cols_shuffled']:>6.3f} {t['cols_x_dy']:>6.3f} {r['infer_dense_ms']:>6.3f} "
                  f"{r['infer_floor_ms']:>6.3f} {r['infer_max_ratio']:>6.2f} {fmt(r['infer_target']):>5} "
                  f"{r['train_eager_ms']:>7.3f} {r['train_floor_ms']:>7.3f} {r['train_max_ratio']:>6.2f} "
                  f"{fmt(r['train_target']):>5}  (probe err {r['probe_rel_err']:.1e})", flush=True)
        del inductor
        torch._dynamo.reset()
    print(f"wrote {out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
