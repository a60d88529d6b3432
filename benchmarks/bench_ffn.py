"""FFN inference: dense eager vs Inductor vs the gate GEMM alone vs twell, in one run.

    python3 benchmarks/bench_ffn.py                      # the full grid
    python3 benchmarks/bench_ffn.py --quick              # K=2048 N=5632, M 16384/65536, 4 densities
    python3 benchmarks/bench_ffn.py --M 16384 --density 0.005 0.02 --tail 0 --shapes 2048x5632
    python3 benchmarks/bench_ffn.py --non-gated --M 4096 16384   # down(relu(gate(x))): rows' gated false
    python3 benchmarks/bench_ffn.py --act relu2 --M 16384 --density 0.005 --tail 0   # squared ReLU (rows' act)
    python3 benchmarks/bench_ffn.py --act drelu --M 16384 --density 0.005 --tail 0   # relu(gate) * relu(up)

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

--activity: the inputs' activity. iid (default): anchors.md's generator over the grid above.
PROFILE.json[:LAYER]: a trained layer's per-neuron rates, position dependence and stickiness
(benchmarks/activity_profile.py writes the profile; testing.make_ffn_activity builds the inputs
at the profile's density and sequence length, --shapes' K x N, the layer by default the
sparsest), e.g. --activity benchmarks/profiles/h100_activity.json:model.layers.3.mlp.
checkpoint:PATH: one layer's real FFN inputs and weights, biases included (activity_profile.py
--checkpoint-out; its tokens tiled to each M, K x N its own). Each row's ``activity`` names the
spec; --reference runs the paper's kernels on the same inputs (benchmarks/reference.py
--activity: its child builds them with testing.make_ffn_for; a checkpoint with biases is
skipped: the reference takes none). At
M=16384, 2048x5632 (H200, 2026-11-26, one run each) twell over Inductor read 1.43x on iid
d=0.005, 1.36x on the H100 profile's layer 3 (d=0.0059) and 1.38x on that layer's checkpoint.

--decode (benchmarks/bench_decode.py): dense eager vs the op (rules included) vs the op with
each decode form forced, each captured in a CUDA graph over several layers' weights (more
bytes than the L2 holds, as in a real model); default --out runs/<gpu>/ffn_decode.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

if __package__ in (None, ""):                  # run as a file: python3 benchmarks/bench_ffn.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_dynamic import OpCalls  # noqa: E402
from benchmarks import reference  # noqa: E402
from benchmarks.rows import out_path, stamp, write_json  # noqa: E402
from benchmarks.timing import gpu_name, interleaved_ms, policy_changes, rel  # noqa: E402

import twell_compile.ops  # noqa: E402,F401  (registers torch.ops.twell)
from twell_compile.reference import ACTS, ffn_dense  # noqa: E402
from twell_compile.runtime import arch, decode_state, density, select  # noqa: E402
from twell_compile.testing import (GatedMLP, PlainMLP, load_activity_profile, load_checkpoint_ffn, load_profile,  # noqa: E402
                                   make_ffn_for, make_ffn_profile, parse_activity)

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
    ap.add_argument("--activity", default="iid", metavar="iid|PROFILE.json[:LAYER]|checkpoint:PATH",
                    help="the inputs' activity (see above; default iid, anchors.md's generator)")
    ap.add_argument("--reference", default=None, metavar="DIR",
                    help="the paper's kernels (the sparser-faster-llms folder, ../shared/anchor/README.md): "
                         "ref_ms / ref_rel_err per point, each in a process of its own (benchmarks/reference.py)")
    ap.add_argument("--ref-timeout", type=float, default=150, help="seconds per reference point")
    ap.add_argument("--out", default=None, help="JSON path (default runs/<gpu>/ffn_inference.json)")
    ap.add_argument("--non-gated", action="store_true", help="the non-gated FFN down(relu(gate(x))) (rows: gated false)")
    ap.add_argument("--act", choices=ACTS, default="relu",
                    help="the activation (rows: act): relu2 = relu(.)**2 in place of relu, drelu = relu(gate) * relu(up)")
    ap.add_argument("--policy", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="run with these fields of the GPU record replaced (arch.patched); rows record them")
    args = ap.parse_args(argv)
    if args.reference:
        print(f"reference {args.reference}: {reference.build(args.reference)}", flush=True)
    if args.quick:
        ms, ds, ts, shapes = [16384, 65536], [0.005, 0.02, 0.05, 1.0], [0.0, 0.2], ["2048x5632"]
    else:
        ms, ds, ts, shapes = FULL_M, FULL_D, FULL_T, FULL_S
    ms, ds, ts, shapes = args.M or ms, args.density or ds, args.tail or ts, args.shapes or shapes
    profile = layer_name = None
    act = resolve_activity(args.activity)
    args.activity = act["spec"]
    if act["kind"] != "iid":
        if args.nnz_profile:
            ap.error("--nnz-profile and --activity replay different things: give one")
        ds, ts = [act["density"]], [0.0]
        if act["kind"] == "checkpoint":
            shapes = [f"{act['k']}x{act['n']}"]
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
    print(f"activity: {act['label']}")
    print(hdr, flush=True)
    torch.set_grad_enabled(False)       # inference: the backend rewrites to the inference op
    with OpCalls(cpu_rule=False) as op_calls, arch.patched(**policy_changes(args.policy)):
        _grid(args, shapes, ms, ds, ts, profile, layer_name, dev, rows, out, op_calls, act["bias"])
    for row in rows:
        row["policy"] = " ".join(args.policy)
    write_json(out, rows)
    print(f"wrote {out} ({len(rows)} rows)")
    return 0


def resolve_activity(spec: str) -> dict:
    """--activity: {"kind", "spec" (a profile's layer named), "label" (the header's), "density",
    and for a checkpoint "k", "n"; "bias": whether the inputs have biases}."""
    kind, path, layer = parse_activity(spec)
    if kind == "iid":
        return dict(kind=kind, spec="iid", label="iid (anchors.md's generator)", density=None, bias=False)
    if kind == "profile":
        name, prof = load_activity_profile(path, layer)
        d = float(f"{float(prof['density']):.4g}")    # the grid's label (and seed); nnz_per_row is measured
        return dict(kind=kind, spec=f"{path}:{name}", density=d, bias=False,
                    label=f"profile {path}:{name} (density {d:.4g}, dead {float(prof['dead_frac']):.1%}, "
                          f"{prof['hidden']} neurons, sequences of {prof['seq']})")
    p = load_checkpoint_ffn(path, 1, "cpu", torch.float32)          # checks the file (ValueError)
    ck = torch.load(path, map_location="cpu", weights_only=True)
    n, k = p["w_gate"].shape
    bias = any(p[key] is not None for key in ("b_gate", "b_up", "b_down"))
    d = float(f"{float(ck.get('density', float('nan'))):.4g}")
    return dict(kind=kind, spec=f"checkpoint:{path}", k=k, n=n, density=d, bias=bias,
                label=f"checkpoint {path} ({ck.get('layer')}, {ck['x'].shape[0]} tokens, density {d:.4g}"
                      f"{', biases' if bias else ''})")


def reference_point(args, m: int, k: int, n: int, d: float, t: float, seed: int, bias: bool,
                    gated: bool = True) -> dict:
    """The paper's kernels on this point's inputs (benchmarks/reference.py, the --activity spec
    passed through); skipped where the inputs have biases, which its kernels do not take."""
    nan = float("nan")
    if bias:
        return dict(ref_ms=nan, ref_rel_err=nan, ref_nan=None,
                    ref_status="skipped: the inputs have biases, the reference kernels take none")
    if not gated:
        return dict(ref_ms=nan, ref_rel_err=nan, ref_nan=None,
                    ref_status="skipped: benchmarks/reference.py runs the paper's gated FFN only")
    return reference.run_point(args.reference, m, k, n, d, t, seed, args.reps, args.rounds, args.ref_timeout,
                               activity=args.activity)


def ffn_module(k: int, n: int, bias: bool, gated: bool = True, act: str = "relu") -> nn.Module:
    """testing.GatedMLP; with biases on its three Linears for a checkpoint's FFN; testing.PlainMLP
    (down(relu(gate(x)))) when not ``gated``; ``act`` other than relu: the same Linears in ActFFN."""
    mod = (GatedMLP(k, n) if gated else PlainMLP(k, n)) if act == "relu" else ActFFN(k, n, gated, act)
    if bias:
        mod.gate, mod.down = nn.Linear(k, n), nn.Linear(n, k)
        if gated:
            mod.up = nn.Linear(k, n)
    return mod


class ActFFN(nn.Module):
    """down(relu(gate(x))**2 [* up(x)]) (relu2) or down(relu(gate(x)) * relu(up(x))) (drelu)."""

    def __init__(self, k: int, n: int, gated: bool, act: str):
        super().__init__()
        self.act = act
        self.gate = nn.Linear(k, n, bias=False)
        self.up = nn.Linear(k, n, bias=False) if gated else None
        self.down = nn.Linear(n, k, bias=False)

    def forward(self, x):
        hg = F.relu(self.gate(x))
        if self.act == "drelu":
            return self.down(hg * F.relu(self.up(x)))
        h = torch.square(hg)
        return self.down(h if self.up is None else h * self.up(x))


def op_path(x, n: int, k_out: int, layer: str, gated: bool = True) -> str:
    """The path the op's next call on x takes for this layer (its rules and lagged density):
    "decode:<form>", "twell" or "dense"."""
    plan = select.plan_infer(x, n, k_out, gated, layer)
    return f"decode:{plan.form}" if plan.path == "decode" else plan.path


def _grid(args, shapes, ms, ds, ts, profile, layer_name, dev, rows, out, op_calls, bias=False) -> None:
    policy = arch.policy_for(dev)
    for shape in shapes:
        k, n = (int(v) for v in shape.split("x"))
        for m in ms:
            # the product and its baseline: one gated FFN module each, weights copied in per point
            gated = not args.non_gated
            act = args.act
            tw_mod = ffn_module(k, n, bias, gated, act).to(dev, torch.bfloat16)
            ind_mod = ffn_module(k, n, bias, gated, act).to(dev, torch.bfloat16)
            inductor = None if args.no_inductor else torch.compile(ind_mod, dynamic=False, mode=args.mode)
            tw = torch.compile(tw_mod, backend="twell", dynamic=False, mode=args.mode)
            rewritten = None             # whether the backend rewrote this M's FFN (a compile-time fact)
            for d in ds:
                for t in ts:
                    seed = hash((m, k, n, d, t)) & 0xFFFF
                    p = (make_ffn_profile(m, k, n, profile, device=dev, seed=seed) if profile is not None
                         else make_ffn_for(args.activity, m, k, n, d, t, gated=gated, device=dev, seed=seed))
                    x = p["x"]
                    for mod in (tw_mod, ind_mod):
                        for name in ("gate", "up", "down") if gated else ("gate", "down"):
                            lin = getattr(mod, name)
                            lin.weight.copy_(p[f"w_{name}"])
                            if bias:
                                lin.bias.copy_(p[f"b_{name}"])
                    # the op and the kernels read the product's weights (rewritten in place here,
                    # so CUDA graphs captured at the first point read this point's weights)
                    up = tw_mod.up if gated else None
                    wg, wu, wd = tw_mod.gate.weight, None if up is None else up.weight, tw_mod.down.weight
                    bg, bu, bd = tw_mod.gate.bias, None if up is None else up.bias, tw_mod.down.bias
                    args7 = (x, wg, bg, wu, bu, wd, bd)
                    layer = f"bench/{m}/{k}/{n}/{d}/{t}"
                    op = lambda: torch.ops.twell.ffn(*args7, layer, False, act=act)
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
                    nnz = float((F.linear(x, wg, bg) > 0).sum()) / m
                    width = select.list_width(policy, n, nnz)
                    # the forced per-row path reads its list width from the layer's measurement:
                    # this point's, landed up front (the op's rules would measure it the same)
                    klayer = f"{layer}/twell"
                    density.landed((klayer, x.device, x.dtype, k, n, k, gated), nnz / n)
                    kern = lambda: torch.ops.twell.ffn(*args7, klayer, False, path="twell", act=act)
                    fns = dict(dense=lambda: ffn_dense(*args7, act), gate=lambda: F.linear(x, wg, bg), op=op,
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
                    y_k = torch.ops.twell.ffn(xr, *args7[1:], klayer, False, path="twell", act=act)
                    ref = ffn_dense(*(a[:r].float() if i == 0 else (None if a is None else a.float())
                                      for i, a in enumerate(args7)), act)
                    err = rel(y_tw, ref)
                    op_err = rel(y_op, ref)
                    kerr = rel(y_k, ref)
                    derr = rel(ffn_dense(*args7, act)[:r], ref)
                    counts = (F.linear(xr, wg, bg) > 0).sum(1)
                    ovf = float((counts > width).float().mean()) * 100     # rows over the list width
                    op_ran = op_path(x, n, k, layer, gated)
                    paper = (reference_point(args, m, k, n, d, t, seed, bias, gated)
                             if args.reference and profile is None and act == "relu" else {})
                    path = ("/".join(tw_paths) or op_ran) if ran_op else "inductor"
                    row = stamp(dict(M=m, K=k, N=n, density=d, tail=t, gated=gated, act=act, dense_ms=dense_ms, inductor_ms=ind_ms,
                                     gate_ms=gate_ms, twell_ms=twell_ms, rel_err=err, dense_rel_err=derr,
                                     op_ms=op_ms, op_rel_err=op_err, op_path=op_ran, mode=args.mode,
                                     kernel_ms=kernel_ms, kernel_rel_err=kerr, nnz_per_row=nnz,
                                     list_width=width, overflow_row_pct=ovf, path=path,
                                     profile=f"{args.nnz_profile}:{layer_name}" if profile is not None else None,
                                     activity=args.activity,
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
                    del p, x, wg, wu, wd, bg, bu, bd, args7
            del inductor, tw, tw_mod, ind_mod
            torch._dynamo.reset()
            decode_state.clear()


if __name__ == "__main__":
    sys.exit(main())
