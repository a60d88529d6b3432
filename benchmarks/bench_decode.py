"""Decode-sized FFN: dense eager vs twell, CUDA graphs for both. Run it as
``python3 benchmarks/bench_ffn.py --decode [flags]`` (or this file directly).

    python3 benchmarks/bench_ffn.py --decode                       # M 1..64 x 4 densities x 2 shapes
    python3 benchmarks/bench_ffn.py --decode --M 64 128 256 512 2048 8192 --density 0.005 \\
        --shapes 2048x5632 --out /tmp/crossover.json               # where each path wins
    python3 benchmarks/bench_ffn.py --decode --act drelu --M 1 16 --density 0.005   # dReLU (relu2: squared ReLU)
    python3 benchmarks/bench_ffn.py --decode --M 16 64 128 256 --density 0.005 --shapes 2048x5632 \\
        --forms pairs union --down-layout transposed                 # W_down stored [N, K_out]
    python3 benchmarks/bench_ffn.py --decode --M 16 64 128 256 --density 0.005 --shapes 2048x5632 \\
        --forms pairs union2 --down-layout transposed                # the union2 form against pairs
    python3 benchmarks/bench_ffn.py --decode --M 64 --density 0.005 --shapes 2048x5632 \
        --forms pairs union2 --down-layout transposed --kernels 5    # each launch's device time

Per (shape, density) LAYERS weight sets are drawn (twell_compile/testing.py, bf16), enough that
one pass reads > ROTATE_MB of weights (several times the 50-60 MB L2): each timed CUDA graph
runs the FFN once per set, like consecutive layers of a model, and times are per layer
(replay median / LAYERS, triton.testing.do_bench). Each W_down gets its persistent decode state
up front (runtime/decode_state.py), as the backend does at compile time.
  dense_ms   eager's calls (ffn_dense), graph-captured
  twell_ms   torch.ops.twell.ffn as the backend calls it (the rules included, warmed up so the
             layer's density has landed before capture): path says what it ran ("decode-<form>",
             "twell" for the per-row path, "dense")
  kernel_ms  the op with its sparse path forced (path=): decode for M <= arch.MAX_M (each of
             its up/down forms timed, form_ms; kernel_ms is the fastest, kernel_form), else the
             per-row path (kernel column: "decode" or "twell"). --forms: only these forms
             (default every form of cuda_decode.FORMS; "rows" only where M <= vec_m)
--down-layout transposed (rows: down_layout): every W_down stored [N, K_out] (w_down.t()
contiguous, as twell_compile.prepare(down_layout="transposed") stores it): the decode kernels'
W_d^T rows are then contiguous; eager's calls read the same tensors.
Bandwidth: peak_GBps is a 1 GiB device-to-device copy (read + write bytes) in the same run;
dense_GBps counts W_gate + W_up + W_down once; twell_GBps counts W_gate plus the W_up and
W_down^T rows of the neurons active in any of the M rows (union, measured per layer), for the
path the op ran. rel_err / dense_rel_err: ||y - y_fp32|| / ||y_fp32|| of the op and of eager
bf16 (fp32 reference with TF32 off). Rows as benchmarks/rows.py stamps them, to --out (default
runs/<gpu>/ffn_decode.json; the canonical files: benchmarks/results/README.md).
--configs / --policy run with tuned decode configs / cost-model constants (tune_decode.py's
files; --configs also takes {padded M: {field: value}}, those fields replaced in the record's
config, e.g. {"64": {"union_s": 8}}) in place of the record's, through arch.patched. --act (rows: act): the activation of
eager's calls, the op's and the fp32 reference: relu, relu2 (relu(g)^2 * u) or drelu
(relu(g) * relu(u)); nnz_per_row and union stay relu(g)'s, the neurons the op reads.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

if __package__ in (None, ""):                  # run as a file: python3 benchmarks/bench_decode.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.rows import out_path, stamp, write_json  # noqa: E402
from benchmarks.timing import gpu_name, kernel_phases, mark_phase, median_ms, rel  # noqa: E402

import twell_compile.ops  # noqa: E402,F401  (registers torch.ops.twell)
from twell_compile.reference import ACTS, ffn_dense  # noqa: E402
from twell_compile.runtime import arch, cuda_decode, decode_state, select  # noqa: E402
from twell_compile.testing import make_ffn  # noqa: E402

DECODE_M = [1, 2, 4, 8, 16, 32, 64]
DECODE_D = [0.005, 0.02, 0.05, 0.2]
DECODE_S = ["2048x5632", "4096x11008"]
ROTATE_MB = 256


def bench(fn, reps: int) -> float:
    return median_ms(fn, reps, warmup=max(5, reps // 4))


def peak_gbps(reps: int) -> float:
    """Device-to-device copy of 1 GiB: (read + write bytes) / median time."""
    a = torch.empty(1 << 29, dtype=torch.float16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a), reps)
    del a, b
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


def graph_ms(fn, reps: int) -> float:
    """fn captured in one CUDA graph (after warm-up calls on a side stream); median replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ms = bench(g.replay, reps)
    del g
    return ms


def weight_sets(m_max: int, k: int, n: int, density: float, tail: float, layers: int, seed: int,
                down_layout: str = "linear") -> list[dict]:
    sets = []
    for r in range(layers):
        p = make_ffn(m_max, k, n, density, tail, device="cuda", seed=seed + r)
        if down_layout == "transposed":        # [N, K_out] storage: w_down.t() is contiguous
            p["w_down"] = p["w_down"].t().contiguous().t()
        decode_state.register(p["w_down"])
        sets.append(p)
    return sets


def layers_for(k: int, n: int, k_out: int, gated: bool, rotate_mb: float) -> int:
    per = 2e-6 * n * (k * (2 if gated else 1) + k_out)
    return max(2, math.ceil(rotate_mb / per))


def per_call_us(phases: list[list[tuple[str, float]]], per_phase: int) -> dict[str, float]:
    """Device us per call of each launch, by kernel name, from ``kernel_phases`` phases that each
    hold ``per_phase`` calls (one phase per profiled step of all layers). Names are cut at their
    first "(" (C++ signatures) and to 80 characters."""
    if not phases or per_phase < 1:
        raise ValueError(f"per_call_us needs phases and per_phase >= 1, got {len(phases)} and {per_phase}")
    out: dict[str, float] = {}
    for phase in phases:
        for name, us in phase:
            key = name.split("(")[0][:80]
            out[key] = out.get(key, 0.0) + us / (len(phases) * per_phase)
    return out


def run_point(sets, m: int, d: float, reps: int, tag: str, act: str = "relu",
              forms: tuple = cuda_decode.FORMS, kernels: int = 0) -> dict:
    """``kernels``: profile that many steps of each forced form and report its launches' device
    time per call (``form_kernels_us``: {form: {kernel: us}}); 0: no profile."""
    k, n, k_out = sets[0]["w_gate"].shape[1], sets[0]["w_gate"].shape[0], sets[0]["w_down"].shape[0]
    gated = sets[0]["w_up"] is not None
    layers = len(sets)
    xs = [p["x"][:m].contiguous() for p in sets]
    args = [(x, p["w_gate"], None, p["w_up"], None, p["w_down"], None) for x, p in zip(xs, sets)]
    names = [f"{tag}/{m}/{r}" for r in range(layers)]

    def dense():
        for a in args:
            ffn_dense(*a, act)

    def op(path="auto"):
        for a, name in zip(args, names):
            torch.ops.twell.ffn(*a, name, False, path=path, act=act)

    for _ in range(3):                      # the rules: first call probes, later calls decide
        op()
        torch.cuda.synchronize()
    plan = select.plan_infer(xs[0], n, k_out, gated, names[0])    # what the next call runs
    path = f"decode-{plan.form}" if plan.path == "decode" else plan.path
    kname = "decode" if m <= arch.MAX_M else "twell"
    nnz = [float((F.linear(x, p["w_gate"]) > 0).sum()) / m for x, p in zip(xs, sets)]
    dense_ms = graph_ms(dense, reps) / layers
    twell_ms = graph_ms(op, reps) / layers
    a0 = args[0]
    form_ms = {}
    if kname == "decode":      # every up/down form the decode path has for this M, forced
        vec_m = arch.policy_for(xs[0].device).decode_config(m, k).vec_m
        for f in (f for f in forms if f != "rows" or m <= vec_m):
            form_ms[f] = graph_ms(lambda: op(f"decode-{f}"), reps) / layers
        if kernels:
            def marked(f):
                mark_phase()
                op(f"decode-{f}")
            form_kernels = {f: per_call_us(kernel_phases(lambda: marked(f), kernels), layers) for f in form_ms}
            form_kernels["dense"] = per_call_us(kernel_phases(lambda: (mark_phase(), dense()), kernels), layers)
        kform = min(form_ms, key=form_ms.get)
        kernel_ms = form_ms[kform]
        kpath = f"decode-{kform}"
    else:                      # the per-row path forced: list width from each layer's measurement
        kform, kpath = None, "twell"
        kernel_ms = graph_ms(lambda: op(kpath), reps) / layers
    if not (kernels and kname == "decode"):
        form_kernels = {}
    y_k = torch.ops.twell.ffn(*a0, names[0], False, path=kpath, act=act)
    # accuracy (layer 0, fresh outputs)
    ref = ffn_dense(*(None if t is None else t.float() for t in a0), act)
    y_op = torch.ops.twell.ffn(*a0, names[0], False, act=act)
    union = sum(float((F.linear(x, p["w_gate"]) > 0).any(0).sum()) for x, p in zip(xs, sets)) / layers
    g = 1 if gated else 0
    dense_bytes = 2 * n * (k * (1 + g) + k_out)
    dec_bytes = 2 * (n * k + union * (g * k + k_out))
    op_bytes = dec_bytes if path.startswith("decode") else dense_bytes
    return dict(M=m, K=k, N=n, density=d, act=act, dense_ms=dense_ms, twell_ms=twell_ms, kernel_ms=kernel_ms,
                kernel=kname, kernel_form=kform, form_ms=form_ms, form_kernels_us=form_kernels, path=path,
                rel_err=rel(y_op, ref),
                dense_rel_err=rel(ffn_dense(*a0, act), ref), kernel_rel_err=rel(y_k, ref), nnz_per_row=sum(nnz) / layers,
                union=union, union_frac=union / n, dense_GBps=dense_bytes / (dense_ms * 1e-3) / 1e9,
                twell_GBps=op_bytes / (twell_ms * 1e-3) / 1e9,
                kernel_GBps=dec_bytes / (kernel_ms * 1e-3) / 1e9 if kname == "decode" else float("nan"),
                layers=layers)


def load_policy(path: str) -> dict[str, Any]:
    """Record fields for arch.patched from a cost-model file (tune_decode.py --policy-out,
    fit_policy.py --fit-decode --out): {"decode_forms": {form: [constants]}, "dense_fixed_us",
    "dense_gbps"}, each optional; forms not given keep the record's."""
    got = json.loads(Path(path).read_text())
    unknown = sorted(set(got) - {"decode_forms", "dense_fixed_us", "dense_gbps"})
    if unknown:
        raise ValueError(f"--policy: unknown fields {unknown} in {path}")
    base = arch.cuda_default()
    out: dict[str, Any] = {name: float(got[name]) for name in ("dense_fixed_us", "dense_gbps") if name in got}
    if "decode_forms" in got:
        forms = dict(base.decode_forms)
        for form, values in got["decode_forms"].items():
            if form not in forms or len(values) != len(forms[form]):
                raise ValueError(f"--policy: form {form!r} wants {len(forms.get(form, ()))} constants "
                                 f"(forms {sorted(forms)}), got {values}")
            forms[form] = tuple(float(v) for v in values)
        out["decode_forms"] = forms
    return out


def load_configs(path: str) -> dict[str, Any]:
    """Record fields for arch.patched from a configs file ({padded M: [arch.DecodeConfig fields in
    order, the first 8 at least]}, tune_decode.py --out, or {padded M: {field: value}}: those
    fields replaced in the record's config; keys "wide:<padded M>" set the configs for K >= the
    record's wide_k); buckets not given keep the record's."""
    base = arch.cuda_default()
    tables = {"decode_configs": dict(base.decode_configs), "wide_decode_configs": dict(base.wide_decode_configs)}
    for mp, vals in json.loads(Path(path).read_text()).items():
        table = tables["wide_decode_configs" if mp.startswith("wide:") else "decode_configs"]
        key = int(mp.removeprefix("wide:"))
        if isinstance(vals, dict):
            unknown = sorted(set(vals) - set(arch.DecodeConfig._fields))
            if unknown:
                raise ValueError(f"--configs: unknown DecodeConfig fields {unknown} in {path}")
            if key not in table:
                raise ValueError(f"--configs: no record config at padded M {mp} to replace fields of, in {path}")
            table[key] = table[key]._replace(**vals)
        else:
            table[key] = arch.DecodeConfig(*vals)
    return tables


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, nargs="+", default=DECODE_M)
    ap.add_argument("--density", type=float, nargs="+", default=DECODE_D)
    ap.add_argument("--tail", type=float, default=0.0)
    ap.add_argument("--shapes", nargs="+", default=DECODE_S, help="KxN pairs, e.g. 2048x5632")
    ap.add_argument("--reps", type=int, default=60, help="do_bench rep (ms)")
    ap.add_argument("--rotate-mb", type=float, default=ROTATE_MB,
                    help="weight bytes one timed pass reads (sets the number of layers)")
    ap.add_argument("--configs", default=None, help="JSON of decode configs to use (tune_decode.py --out)")
    ap.add_argument("--policy", default=None, help="JSON of decode-rule constants to use (tune_decode.py --policy-out)")
    ap.add_argument("--act", choices=ACTS, default="relu",
                    help="the activation (rows: act): relu2 = relu(gate)**2 * up, drelu = relu(gate) * relu(up)")
    ap.add_argument("--forms", nargs="+", choices=cuda_decode.FORMS, default=list(cuda_decode.FORMS),
                    help="the decode forms timed forced (form_ms; kernel_ms is the fastest of them)")
    ap.add_argument("--down-layout", choices=("linear", "transposed"), default="linear",
                    help="W_down storage: nn.Linear's [K_out, N], or [N, K_out] (w_down.t() contiguous, "
                         "as twell_compile.prepare(down_layout='transposed') stores it)")
    ap.add_argument("--kernels", type=int, default=0, metavar="STEPS",
                    help="profile STEPS steps of each forced form and of dense: device us per call of each "
                         "launch (rows: form_kernels_us); 0: none")
    ap.add_argument("--out", default=None, help="JSON path (default runs/<gpu>/ffn_decode.json)")
    args = ap.parse_args(argv)
    if args.kernels < 0:
        raise ValueError(f"--kernels takes a number of profiled steps >= 0, got {args.kernels}")
    for m in args.M:
        if m < 1:
            raise ValueError(f"--M values must be >= 1, got {m}")
    for d in args.density:
        if not 0.0 < d <= 1.0:
            raise ValueError(f"--density values must be in (0, 1], got {d}")
    shapes = []
    for sh in args.shapes:
        try:
            k, n = (int(v) for v in sh.split("x"))
        except ValueError:
            raise ValueError(f"--shapes takes KxN pairs like 2048x5632, got {sh!r}") from None
        shapes.append((k, n))
    changes = {**(load_configs(args.configs) if args.configs else {}),
               **(load_policy(args.policy) if args.policy else {})}
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode needs a CUDA device")
    with arch.patched(**changes):
        return grid(args, shapes)


def grid(args, shapes) -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    peak = peak_gbps(args.reps)
    print(f"{torch.cuda.get_device_name()}: peak copy bandwidth {peak:.0f} GB/s", flush=True)
    out = out_path(args.out, gpu_name(), "ffn_decode.json")
    rows = []
    hdr = (f"{'M':>5} {'K':>5} {'N':>6} {'dens':>6} {'union%':>6} {'dense':>7} {'twell':>7} {'kernel':>7} "
           f"{'x_op':>5} {'x_krn':>5} {'dGB/s':>6} {'tGB/s':>6} {'%peak':>5} {'err':>8} {'d_err':>8} path")
    print(hdr, flush=True)
    for k, n in shapes:
        for d in args.density:
            layers = layers_for(k, n, k, True, args.rotate_mb)
            sets = weight_sets(max(args.M), k, n, d, args.tail, layers, seed=hash((k, n, d)) & 0xFFFF,
                               down_layout=args.down_layout)
            for m in args.M:
                row = stamp({**run_point(sets, m, d, args.reps, f"bench_decode/{k}/{n}/{d}/{args.act}", args.act,
                                         tuple(args.forms), args.kernels),
                             "tail": args.tail, "down_layout": args.down_layout,
                             "peak_GBps": peak}, "cuda")
                rows.append(row)
                print(f"{m:>5} {k:>5} {n:>6} {d:>6} {100 * row['union_frac']:>6.1f} {row['dense_ms'] * 1e3:>6.1f}u "
                      f"{row['twell_ms'] * 1e3:>6.1f}u {row['kernel_ms'] * 1e3:>6.1f}u "
                      f"{row['dense_ms'] / row['twell_ms']:>5.2f} {row['dense_ms'] / row['kernel_ms']:>5.2f} "
                      f"{row['dense_GBps']:>6.0f} {row['twell_GBps']:>6.0f} {100 * row['twell_GBps'] / peak:>4.0f}% "
                      f"{row['rel_err']:>8.1e} {row['dense_rel_err']:>8.1e} {row['path']}"
                      + ("  ERR>2x" if row["rel_err"] > 2 * row["dense_rel_err"] else "")
                      + "".join(f" {f} {t * 1e3:.1f}u" for f, t in row["form_ms"].items()), flush=True)
                for f, parts in row["form_kernels_us"].items():
                    print(f"      {f:>6}: " + ", ".join(f"{name} {us:.1f}u" for name, us in parts.items()), flush=True)
                write_json(out, rows)     # after every row: partial runs keep data
            del sets
            decode_state.clear()
            torch.cuda.empty_cache()
    ratios = [r["dense_ms"] / r["twell_ms"] for r in rows]
    print(f"wrote {out} ({len(rows)} rows); twell vs dense: min {min(ratios):.2f}x, max {max(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
