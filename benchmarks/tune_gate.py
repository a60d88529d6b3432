"""Time the fused gate GEMM (twell::gate_pack, csrc/gate_pack*.cu) against cuBLAS's gate GEMM, per
kernel configuration and tile order: the numbers behind the record's gate_cfg, gate_raster and
gate_swizzle (runtime/arch.py), and #43's "within 1.03x of cuBLAS" rows.

    python3 benchmarks/tune_gate.py --M 2048 4096 16384 65536 [--configs 0 1 2 3]
        [--raster 0 1 2] [--swizzle 1 2 4] [--out benchmarks/results/<gpu>/gate_pack.json]

Per M (bf16, K x N gate, make_ffn's inputs at --density): cuBLAS's F.linear; each variant's
gate_pack with g written whole (gate_ms) and only where the packing spills (spills_ms, the
per-row path's); the lists both ways (cuBLAS + compact_rows against gate_pack g="spills" +
merge_rows); the whole per-row path (twell_forward) both ways (--whole); with
--parts, CUTLASS's own GEMM at each variant's tile and the variant's g and packing apart; and
the per-row path's error against fp32 beside eager bf16's. One row per (M, variant) in rows.py's schema. Timings are
do_bench medians in one process, variants interleaved with cuBLAS (timing.interleaved_ms).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):                  # run as a file: python3 benchmarks/tune_gate.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.rows import save_rows, stamp  # noqa: E402
from benchmarks.timing import gpu_name, interleaved_ms, rel  # noqa: E402

from twell_compile.build import PROBES, load  # noqa: E402
from twell_compile.reference import ffn_dense  # noqa: E402
from twell_compile.runtime import arch, cuda_gate, cuda_infer, select  # noqa: E402
from twell_compile.testing import make_ffn  # noqa: E402


def point(a, m: int, variants: list[tuple[int, int, int]]) -> list[dict]:
    p = make_ffn(m, a.K, a.N, a.density, 0.0)
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    record = arch.policy_for(x.device)
    nnz = float((F.linear(x, wg) > 0).sum()) / m
    width = select.list_width(record, a.N, nnz)
    nb = record.row_buckets
    g0 = F.linear(x, wg)
    fns = {"cublas": lambda: F.linear(x, wg),
           "cublas+compact": lambda: cuda_infer.compact_rows(F.linear(x, wg), width, buckets=nb),
           "compact": lambda: cuda_infer.compact_rows(g0, width, buckets=nb)}
    for cfg, raster, swz in variants:
        key = f"cfg{cfg}/r{raster}/s{swz}"
        tn = cuda_gate.CONFIGS[cfg].tile_n
        fns[key] = (lambda c=cfg, r=raster, s=swz: cuda_gate.gate_pack(x, wg, None, c, a.slots, r, s))
        fns[key + "/spills"] = (lambda c=cfg, r=raster, s=swz: cuda_gate.gate_pack(x, wg, None, c, a.slots, r, s,
                                                                                   g="spills"))
        fns[key + "+merge"] = (lambda c=cfg, r=raster, s=swz, t=tn: cuda_infer.merge_rows(    # the per-row path's
            *cuda_gate.gate_pack(x, wg, None, c, a.slots, r, s, g="spills"), width, nb, tile_n=t))
        tiles = cuda_gate.gate_pack(x, wg, None, cfg, a.slots, raster, swz)
        fns[key + "/merge"] = (lambda t=tiles: cuda_infer.merge_rows(*t, width, nb))
        if a.parts:
            out_buf = torch.empty((m, a.N), dtype=x.dtype, device=x.device)
            probe = load("cutlass_gemm", directory=PROBES)
            fns[key + "/stock"] = (lambda c=cfg, r=raster, s=swz, o=out_buf: probe.gemm(x, wg, o, c, r, s))
            fns[key + "/g-only"] = (lambda c=cfg, r=raster, s=swz: cuda_gate.gate_pack(x, wg, None, c, 0, r, s))
            fns[key + "/pack-only"] = (lambda c=cfg, r=raster, s=swz: cuda_gate.gate_pack(
                x, wg, None, c, a.slots, r, s, g="none"))
    ms = interleaved_ms(fns, a.reps, rounds=a.rounds)
    rr = min(m, 4096)
    ref = ffn_dense(x[:rr].float(), wg.float(), None, wu.float(), None, wd.float(), None)
    eager_err = rel(ffn_dense(x[:rr], wg, None, wu, None, wd, None), ref)
    whole = {"cublas": lambda: _patched_forward(x, wg, wu, wd, width, -1, 0, 1, a.slots)}
    out = []
    base = dict(M=m, K=a.K, N=a.N, density=a.density, nnz_per_row=round(nnz, 2), width=width, slots=a.slots)
    with with_gate(-1, 0, 1, a.slots):
        y = cuda_infer.twell_forward(x[:rr], wg, None, wu, None, wd, None, width)[0]
    out.append(stamp(dict(base, variant="cublas", gate_ms=ms["cublas"], lists_ms=ms["cublas+compact"],
                          pass_ms=ms["compact"], gate_vs_cublas=1.0, err=rel(y, ref), eager_err=eager_err)))
    print(f"M={m} nnz/row {nnz:.1f} W={width}: cuBLAS {ms['cublas']:.4f} ms, +compact {ms['cublas+compact']:.4f} "
          f"(compact_rows alone {ms['compact']:.4f})", flush=True)
    for cfg, raster, swz in variants:
        key = f"cfg{cfg}/r{raster}/s{swz}"
        g, packed, tcnt = cuda_gate.gate_pack(x, wg, None, cfg, a.slots, raster, swz)
        spilled = int((tcnt > a.slots).sum())
        with with_gate(cfg, raster, swz, a.slots):
            y = cuda_infer.twell_forward(x[:rr], wg, None, wu, None, wd, None, width)[0]
            whole[key] = (lambda c=cfg, r=raster, s=swz: _patched_forward(x, wg, wu, wd, width, c, r, s, a.slots))
        err = rel(y, ref)
        row = dict(base, variant=key, config=cuda_gate.CONFIGS[cfg].what, gate_ms=ms[key], lists_ms=ms[key + "+merge"],
                   pass_ms=ms[key + "/merge"],
                   gate_vs_cublas=ms[key] / ms["cublas"], spills_ms=ms[key + "/spills"],
                   spills_vs_cublas=ms[key + "/spills"] / ms["cublas"], spilled_tiles=spilled, err=err,
                   eager_err=eager_err)
        if a.parts:
            row.update(stock_ms=ms[key + "/stock"], g_only_ms=ms[key + "/g-only"], pack_only_ms=ms[key + "/pack-only"])
            print(f"    {key} parts: CUTLASS's own GEMM {ms[key + '/stock']:.4f}, g only {ms[key + '/g-only']:.4f}, "
                  f"packing only {ms[key + '/pack-only']:.4f}", flush=True)
        out.append(stamp(row))
        print(f"    {key}: gate+pack {ms[key]:.4f} ms = {ms[key] / ms['cublas']:.3f}x cuBLAS, g only where it "
              f"spills {ms[key + '/spills']:.4f} = {ms[key + '/spills'] / ms['cublas']:.3f}x; +merge "
              f"{ms[key + '+merge']:.4f} (merge_rows alone {ms[key + '/merge']:.4f}; cuBLAS+compact "
              f"{ms['cublas+compact']:.4f}); err {err:.2e} eager "
              f"{eager_err:.2e}{'  ERR>2x' if err > 2 * eager_err else ''}; tiles over slots {spilled}", flush=True)
        del g, packed, tcnt
    if a.whole:
        wms = interleaved_ms(whole, a.reps, rounds=a.rounds)
        for row in out:
            row["forward_ms"] = wms.get(row["variant"])
        print("    twell_forward: " + ", ".join(f"{k} {v:.4f}" for k, v in wms.items()), flush=True)
    return out


def with_gate(cfg, raster, swz, slots):
    """The record with this gate (cfg -1: cuBLAS and the compaction) at every token count: the
    record's own gate_min_m would send smaller calls to cuBLAS whatever cfg says."""
    return arch.patched(gate_cfg=cfg, gate_min_m=0, gate_raster=raster, gate_swizzle=swz, gate_slots=slots)


def _patched_forward(x, wg, wu, wd, width, cfg, raster, swz, slots):
    with with_gate(cfg, raster, swz, slots):
        return cuda_infer.twell_forward(x, wg, None, wu, None, wd, None, width)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, nargs="+", default=[2048, 4096, 16384, 65536])
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--N", type=int, default=5632)
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--configs", type=int, nargs="+", default=list(range(len(cuda_gate.CONFIGS))))
    ap.add_argument("--raster", type=int, nargs="+", default=[0], help="0 heuristic, 1 along M, 2 along N")
    ap.add_argument("--swizzle", type=int, nargs="+", default=[1])
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--reps", type=int, default=300, help="ms of timing per variant, over all rounds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--whole", action="store_true", help="also time twell_forward per variant")
    ap.add_argument("--parts", action="store_true",
                    help="also time, per variant, CUTLASS's own GEMM at its tile (benchmarks/probes/cutlass_gemm*.cu), "
                         "its g alone (no packing) and its packing alone (no g)")
    ap.add_argument("--out", help="results JSON (default runs/<gpu>/gate_pack.json)")
    a = ap.parse_args(argv)
    for c in a.configs:
        if not 0 <= c < len(cuda_gate.CONFIGS):
            raise ValueError(f"--configs: {c} is not one of 0..{len(cuda_gate.CONFIGS) - 1}")
    if not torch.cuda.is_available():
        raise SystemExit("tune_gate.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    variants = [(c, r, s) for c in a.configs for r in a.raster for s in a.swizzle]
    rows = [row for m in a.M for row in point(a, m, variants)]
    save_rows(rows, a.out, gpu_name(), "gate_pack.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
