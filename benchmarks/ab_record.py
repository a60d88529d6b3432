"""A/B of GPU-record variants on the per-row path's GPU time: ``twell_forward`` (list width W)
captured in one CUDA graph per variant and replayed, variants timed in interleaved rounds
(timing.interleaved_ms), so host time and launch gaps between calls do not count. Each variant's
y is compared bit for bit with the first variant's. Whether a call splits its heaviest rows is
the plan's rule (select.splits_rows) under the variant's record, from a first call's counts
(the row's ``split``).

    python3 benchmarks/ab_record.py --M 2048 4096 8192 16384 --gated both \\
        --variants compact_transpose=0 compact_transpose=1 --out benchmarks/results/h100/ffn_compact_transpose_ab.json

A variant is a space-free list of FIELD=VALUE pairs joined by "," (GpuPolicy fields, as
--policy elsewhere). One row per (M, gated): ``ms`` maps each variant to its median ms,
``y_bit_equal`` each variant to whether its y equals the first's, ``y_rel_diff`` its relative
difference from the first's (a variant that sums in another order differs in the last bits).
--activity: bench_ffn.py's (iid, a profile's layer, a checkpoint), e.g.

    python3 benchmarks/ab_record.py --M 2048 4096 --gated yes \
        --activity benchmarks/profiles/h100_activity.json:model.layers.3.mlp \
        --variants row_buckets=2 row_buckets=8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):                  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.rows import save_rows, stamp  # noqa: E402
from benchmarks.timing import gpu_name, interleaved_ms, policy_changes  # noqa: E402

from twell_compile.runtime import arch, cuda_infer, select  # noqa: E402
from twell_compile.testing import make_ffn_for, parse_activity  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--N", type=int, default=5632)
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--activity", default="iid", metavar="iid|PROFILE.json[:LAYER]|checkpoint:PATH",
                    help="the inputs' activity, as bench_ffn.py's (default iid: make_ffn at --density)")
    ap.add_argument("--width", type=int, default=256, help="per-row list width W")
    ap.add_argument("--gated", choices=("yes", "no", "both"), default="both")
    ap.add_argument("--variants", nargs="+", required=True, metavar="F=V[,F=V...]")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    parse_activity(a.activity)                     # a bad spec fails before the GPU check
    if not torch.cuda.is_available():
        raise SystemExit("ab_record.py times CUDA graphs: it needs a GPU")
    variants = {v: policy_changes(v.split(",")) for v in a.variants}
    rows = []
    for gated in {"yes": (True,), "no": (False,), "both": (True, False)}[a.gated]:
        for m in a.M:
            p = make_ffn_for(a.activity, m, a.K, a.N, a.density, gated=gated)
            args = tuple(p.get(f) for f in ("x", "w_gate", "b_gate", "w_up", "b_up", "w_down", "b_down"))
            fns, ys, splits = {}, {}, {}
            for name, patch in variants.items():
                with arch.patched(**patch):
                    cnt = cuda_infer.twell_forward(*args, a.width)[1].float()
                    n = args[1].shape[0]
                    split = splits[name] = select.splits_rows(arch.launch_policy(args[0].device), m,
                                                              float(cnt.mean()) / n, float(cnt.max()), n)
                    for _ in range(2):                      # compile and warm up outside the capture
                        cuda_infer.twell_forward(*args, a.width, split=split)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        ys[name] = cuda_infer.twell_forward(*args, a.width, split=split)[0]
                graph.replay()
                fns[name] = graph.replay
            torch.cuda.synchronize()
            first = ys[a.variants[0]]
            ms = interleaved_ms(fns, reps=a.reps, rounds=a.rounds)
            ref = first.float().norm().clamp_min(1e-30)
            row = stamp(dict(M=m, K=a.K, N=a.N, density=a.density, tail=0.0, gated=gated, width=a.width,
                             activity=a.activity, ms=ms, split=splits,
                             y_bit_equal={k: bool(torch.equal(y, first)) for k, y in ys.items()},
                             y_rel_diff={k: float((y.float() - first.float()).norm() / ref) for k, y in ys.items()},
                             method="twell_forward replayed from a CUDA graph per variant, interleaved rounds"))
            rows.append(row)
            print(f"M={m} {'gated' if gated else 'non-gated'}: " +
                  ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in ms.items()), flush=True)
    save_rows(rows, a.out, gpu_name(), "ab_record.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
