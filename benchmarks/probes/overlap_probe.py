"""Can the per-row path's gate GEMM and its sparse phase overlap, and do hot neurons pay as a
dense sub-GEMM? Design probes against the per-row path's ceiling, one device run (results and
reading: docs/inference.md "Designs measured against the 1.7x targets"):

    python3 benchmarks/probes/overlap_probe.py --out runs/overlap.json

1. Overlap (i.i.d. inputs, anchors.md's generator): the gate GEMM is cuBLAS (tensor cores), the
   sparse phase (compaction + row kernel) gathers weight rows from L2. Each variant runs the
   forward over row chunks, chunk c's sparse phase on a second stream while chunk c+1's GEMM
   runs, and reports ms against the serial forward (cuda_infer.twell_forward):
     streams   two plain streams;
     carve<S>  the GEMM told to leave S SMs free (torch._C._set_sm_carveout_experimental:
               cuBLASLt's SM count target), the sparse phase on a plain stream;
     green<A>  the GEMM on a green context of A SMs, the sparse phase on a plain stream, and
               (green<A>/<B>) on a green context of B SMs.
   Each part alone on its share is timed too, so a gain can be told from a partition's cost.
2. Hot neurons (an activity profile's layer, --profile): the h busiest neurons of the input
   (counted on it: an oracle for what a layer's running counts would give) as a dense
   sub-GEMM (gate and up in one GEMM of N + h columns, relu * mul, down over h columns), the
   rest through the per-row path, against the per-row path over all N.
3. The row kernel at one warp per token (row_cols_per_warp = K): shuffle-only reductions.

Every variant's output is checked against the serial forward (relative error printed); a
variant that fails prints its error and the probe goes on. Probe code: it ships nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.timing import gpu_name, median_ms, rel  # noqa: E402
from twell_compile.runtime import arch, cuda_infer  # noqa: E402
from twell_compile.runtime.launch import sm_count  # noqa: E402
from twell_compile.runtime.select import list_width  # noqa: E402
from twell_compile.testing import load_activity_profile, make_ffn, make_ffn_activity  # noqa: E402


def serial(p, width):
    return cuda_infer.twell_forward(p["x"], p["w_gate"], None, p["w_up"], None, p["w_down"], None, width)[0]


def sparse_phase(x, g, w_up, w_down, width):
    return cuda_infer.fused_rows(x, cuda_infer.compact_rows(g, width), w_up, None, w_down, None)[0]


@contextlib.contextmanager
def carveout(sms):
    """cuBLASLt matmuls leave ``sms`` SMs free within the block (None: no change)."""
    if sms is not None:
        torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        if sms is not None:
            torch._C._set_sm_carveout_experimental(None)


def pipelined(p, width, chunks, s_gemm, s_rows, carve=None):
    """Chunked forward: GEMM of chunk c on s_gemm, its sparse phase on s_rows after it."""
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    m = x.shape[0]
    step = -(-m // chunks)
    main = torch.cuda.current_stream()
    s_gemm.wait_stream(main)
    s_rows.wait_stream(main)
    outs, keep = [], []            # keep: each chunk's g alive until both streams are joined
    with carveout(carve):
        for c0 in range(0, m, step):
            xc = x[c0:c0 + step]
            with torch.cuda.stream(s_gemm):
                g = F.linear(xc, wg)
                ev = torch.cuda.Event()
                ev.record(s_gemm)
            with torch.cuda.stream(s_rows):
                s_rows.wait_event(ev)
                outs.append(sparse_phase(xc, g, wu, wd, width))
            keep.append(g)
    main.wait_stream(s_gemm)
    main.wait_stream(s_rows)
    return torch.cat(outs)


def part_alone(p, width, stream, what, carve=None):
    main = torch.cuda.current_stream()
    stream.wait_stream(main)
    with carveout(carve), torch.cuda.stream(stream):
        out = (F.linear(p["x"], p["w_gate"]) if what == "gemm"
               else sparse_phase(p["x"], p["g"], p["w_up"], p["w_down"], width))
    main.wait_stream(stream)
    return out


def hot_split(p, width, ws):
    """Per-row path over the cold neurons + dense sub-GEMM over the hot ones. ws: permuted
    weights (cold first, then hot) as the probe prepared them once."""
    x = p["x"]
    n_cold = ws["w_up_cold"].shape[0]
    gu = F.linear(x, ws["w_gate_up"])                     # [M, N + h]: gate (cold, hot), up (hot)
    g = gu[:, :n_cold]
    n = ws["n"]
    y = sparse_phase(x, g, ws["w_up_cold"], ws["w_down_cold"], width)
    h = torch.relu(gu[:, n_cold:n]) * gu[:, n:]
    return torch.addmm(y, h, ws["w_down_hot_t"])


def timed(results, key, fn, ref, reps):
    try:
        out = fn()
        err = rel(out, ref)
        ms = median_ms(fn, reps)
        results[key] = {"ms": round(ms, 4), "rel_err_vs_serial": float(f"{err:.3g}")}
        print(f"  {key:28s} {ms:8.4f} ms   err vs serial {err:.2e}", flush=True)
    except Exception as e:  # noqa: BLE001 - a probe records every variant's failure and goes on
        results[key] = {"error": f"{type(e).__name__}: {e}"}
        print(f"  {key:28s} FAILED {type(e).__name__}: {e}", flush=True)
        traceback.print_exc(limit=2)


def overlap_point(m, d, reps, green_sms, carves, chunk_list):
    p = make_ffn(m, 2048, 5632, d)
    width = list_width(arch.launch_policy(p["x"].device), 5632, d * 5632)
    res = {"M": m, "density": d, "width": width}
    ref = serial(p, width)
    p["g"] = F.linear(p["x"], p["w_gate"])
    dense = lambda: F.linear(torch.relu(F.linear(p["x"], p["w_gate"])) * F.linear(p["x"], p["w_up"]), p["w_down"])  # noqa: E731
    print(f"M={m} d={d} W={width}", flush=True)
    timed(res, "eager_dense", dense, dense(), reps)
    timed(res, "serial", lambda: serial(p, width), ref, reps)
    main = torch.cuda.current_stream()
    timed(res, "gemm_alone", lambda: F.linear(p["x"], p["w_gate"]), p["g"], reps)
    timed(res, "sparse_alone", lambda: sparse_phase(p["x"], p["g"], p["w_up"], p["w_down"], width), ref, reps)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for c in chunk_list:
        timed(res, f"serial_chunks{c}", lambda c=c: pipelined(p, width, c, main, main), ref, reps)
        timed(res, f"streams_chunks{c}", lambda c=c: pipelined(p, width, c, s1, s2), ref, reps)
    for cv in carves:
        timed(res, f"carve{cv}_gemm_alone", lambda cv=cv: part_alone(p, width, s1, "gemm", cv), p["g"], reps)
        for c in chunk_list:
            timed(res, f"carve{cv}_chunks{c}", lambda c=c, cv=cv: pipelined(p, width, c, s1, s2, cv), ref, reps)
    from torch.cuda.green_contexts import GreenContext
    total = sm_count(p["x"].device)
    for a in green_sms:
        try:
            ga = GreenContext.create(num_sms=a, device_id=torch.cuda.current_device())
            sa = ga.Stream()
        except Exception as e:  # noqa: BLE001
            res[f"green{a}"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"  green{a} FAILED {e}", flush=True)
            continue
        timed(res, f"green{a}_gemm_alone", lambda sa=sa: part_alone(p, width, sa, "gemm"), p["g"], reps)
        for c in chunk_list:
            timed(res, f"green{a}_chunks{c}", lambda c=c, sa=sa: pipelined(p, width, c, sa, s2), ref, reps)
        b = total - a
        try:
            gb = GreenContext.create(num_sms=b, device_id=torch.cuda.current_device())
            sb = gb.Stream()
            timed(res, f"green{a}/{b}_sparse_alone", lambda sb=sb: part_alone(p, width, sb, "sparse"), ref, reps)
            for c in chunk_list:
                timed(res, f"green{a}/{b}_chunks{c}", lambda c=c, sa=sa, sb=sb: pipelined(p, width, c, sa, sb),
                      ref, reps)
        except Exception as e:  # noqa: BLE001
            res[f"green{a}/{b}"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"  green{a}/{b} FAILED {e}", flush=True)
    with arch.patched(row_cols_per_warp=2048):       # one warp per token at K=2048
        timed(res, "serial_cols_per_warp2048", lambda: serial(p, width), ref, reps)
    return res


def hot_point(m, profile, layer, reps, hots):
    _, prof = load_activity_profile(profile, layer)
    p = make_ffn_activity(m, 2048, 5632, prof, seq=int(prof["seq"]), device="cuda")
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    g = F.linear(x, wg)
    per_neuron = (g > 0).sum(0)
    d = float(per_neuron.sum()) / g.numel()
    width = list_width(arch.launch_policy(x.device), g.shape[1], d * g.shape[1])
    res = {"M": m, "profile": profile, "layer": layer, "density": d, "width": width}
    print(f"hot neurons: M={m} d={d:.4f} W={width}", flush=True)
    ref = serial(p, width)
    timed(res, "serial", lambda: serial(p, width), ref, reps)
    order = torch.argsort(per_neuron, descending=True)
    n = g.shape[1]
    for h in hots:
        hot_idx = order[:h].sort().values
        mask = torch.ones(n, dtype=torch.bool, device=x.device)
        mask[hot_idx] = False
        cold_idx = mask.nonzero().squeeze(1)
        share = float(per_neuron[hot_idx].sum()) / float(per_neuron.sum())
        ws = {"n": n, "w_gate_up": torch.cat([wg[cold_idx], wg[hot_idx], wu[hot_idx]]),
              "w_up_cold": wu[cold_idx].contiguous(), "w_down_cold": wd[:, cold_idx].contiguous(),
              "w_down_hot_t": wd[:, hot_idx].t().contiguous()}
        key = f"hot{h}"
        timed(res, key, lambda ws=ws: hot_split(p, width, ws), ref, reps)
        if key in res and "ms" in res[key]:
            res[key]["pair_share"] = round(share, 4)
            print(f"    hot {h} neurons hold {share:.1%} of the pairs", flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--M", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--green", type=int, nargs="*", default=[96, 112, 120])
    ap.add_argument("--carve", type=int, nargs="*", default=[16, 32])
    ap.add_argument("--chunks", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--profile", default="benchmarks/profiles/h100_activity.json")
    ap.add_argument("--layer", default="model.layers.3.mlp")
    ap.add_argument("--hot", type=int, nargs="*", default=[128, 256, 512, 1024])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "sms": sm_count(torch.device("cuda")),
           "overlap": [], "hot": []}
    for m in args.M:
        out["overlap"].append(overlap_point(m, args.density, args.reps, args.green, args.carve, args.chunks))
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
    if args.profile:
        for m in args.M:
            out["hot"].append(hot_point(m, args.profile, args.layer, args.reps, args.hot))
            if args.out:
                Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{gpu_name()} done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
