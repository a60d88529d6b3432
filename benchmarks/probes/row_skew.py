"""How skewed the per-row path's rows are, and what that costs a program per row: a model, not
a timing (no GPU needed).

    python3 benchmarks/probes/row_skew.py --M 2048 4096 \\
        --activity iid benchmarks/profiles/h100_activity.json:model.layers.3.mlp

Per point: the listed pairs per row (min(count, W) at the record's list width) and the row
kernel's schedule modelled as programs of cost ``overhead + pairs`` handed to ``slots`` resident
programs; ``stretch`` is the modelled time over the perfectly balanced one (total cost / slots),
with rows taken heaviest first (``row_buckets`` > 2, to within a bucket), ``stretch_rows`` in row
order (the order within ``row_buckets=2``'s second bucket). A program's pairs form one dependent
chain (each pair's weight rows loaded, then reduced), so where the longest row's chain exceeds
the mean load per slot the wave waits on it.
The inputs are testing.make_ffn_for's, in fp32 on the CPU (counts close to the GPU's bf16 ones).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):                  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from twell_compile.runtime import arch, select  # noqa: E402
from twell_compile.testing import make_ffn_for  # noqa: E402


def stretch(pairs: list[int], slots: int, overhead: float, heaviest_first: bool = True) -> float:
    """Modelled time of rows of ``pairs`` on ``slots`` programs at once (heaviest first, or in
    the order given), over the balanced time."""
    jobs = sorted(pairs, reverse=True) if heaviest_first else list(pairs)
    free = [0.0] * slots
    for c in jobs:
        heapq.heappush(free, heapq.heappop(free) + overhead + c)
    balanced = sum(overhead + c for c in jobs) / slots
    return max(free) / balanced if balanced else 1.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--N", type=int, default=5632)
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--activity", nargs="+", default=["iid"])
    ap.add_argument("--slots", type=int, nargs="+", default=[924],
                    help="resident row programs: the H200's 132 SMs x 7 (the row kernel at its record's launch, "
                         "135 registers x 64 threads: sass_loop.py rows --set PF=1 STAGES=1)")
    ap.add_argument("--overhead", type=float, default=8.0, help="a program's fixed cost, in pairs")
    ap.add_argument("--record", default="H200", help="the GPU record whose list width applies")
    a = ap.parse_args(argv)
    rec = getattr(arch, a.record, None)
    if not isinstance(rec, arch.GpuPolicy):
        raise ValueError(f"--record {a.record!r}: want a GpuPolicy of runtime/arch.py (H100, H200)")
    for spec in a.activity:
        for m in a.M:
            p = make_ffn_for(spec, m, a.K, a.N, a.density, gated=True, dtype=torch.float32, device="cpu", seed=1)
            cnt = (F.linear(p["x"], p["w_gate"], p.get("b_gate")) > 0).sum(1)
            width = select.list_width(rec, a.N, float(cnt.float().mean()))
            pairs = cnt.clamp(max=width).tolist()
            q = torch.quantile(cnt.float(), torch.tensor([0.5, 0.99])).tolist()
            row = dict(activity=spec, M=m, width=width, mean=round(float(cnt.float().mean()), 1), p50=q[0], p99=q[1],
                       max=int(cnt.max()))
            for s in a.slots:
                row[f"stretch_{s}"] = round(stretch(pairs, s, a.overhead), 2)
                row[f"stretch_rows_{s}"] = round(stretch(pairs, s, a.overhead, heaviest_first=False), 2)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
