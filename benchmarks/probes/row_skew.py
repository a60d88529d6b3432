"""How skewed the per-row path's rows are, and what that costs a program per row: a model, not
a timing (no GPU needed).

    python3 benchmarks/probes/row_skew.py --M 2048 4096 \\
        --activity iid benchmarks/profiles/h100_activity.json:model.layers.3.mlp

Per point: the listed pairs per row (min(count, W) at the record's list width) and the row
kernel's schedule modelled as programs of cost ``overhead + pairs`` handed, in the kernel's
order (heaviest first), to ``slots`` resident programs; ``stretch`` is the modelled time over the
perfectly balanced one (total cost / slots). A program's pairs form one dependent chain (each
pair's weight rows loaded, then reduced), so where the longest row's chain exceeds the mean
load per slot the wave waits on it. ``split`` applies the record's row_split (or --split
PARTS,PAIRS,ROWS) as kernels/twell_rows.py cuts rows (``_split_range``), each part a program.
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


def split_parts(pairs: int, heavy: bool, parts: int, seg: int) -> list[int]:
    """A row's pairs per program as the row kernel cuts it (``_split_range``)."""
    if not heavy or parts <= 1 or pairs <= seg:
        return [pairs]
    s = min(-(-pairs // seg), parts)
    size = -(-pairs // s)
    s = -(-pairs // size)
    return [min(size, pairs - i * size) for i in range(s)]


def stretch(pairs: list[int], slots: int, overhead: float, parts: int = 1, seg: int = 0, rows: int = 0) -> float:
    """Modelled time of ``pairs`` (heaviest first) on ``slots`` programs at once, over the
    balanced time; the first ``rows`` rows split as the kernel does."""
    jobs = [c for i, p in enumerate(sorted(pairs, reverse=True)) for c in split_parts(p, i < rows, parts, seg)]
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
    ap.add_argument("--record", default="H200", help="the GPU record whose list width and row_split apply")
    ap.add_argument("--split", default=None, metavar="PARTS,PAIRS,ROWS",
                    help="row_split, row_split_pairs, row_split_rows (default: the record's; 4,48,256 where it is off)")
    a = ap.parse_args(argv)
    rec = getattr(arch, a.record, None)
    if not isinstance(rec, arch.GpuPolicy):
        raise ValueError(f"--record {a.record!r}: want a GpuPolicy of runtime/arch.py (H100, H200)")
    if a.split is not None:
        try:
            parts, seg, rows = (int(v) for v in a.split.split(","))
        except ValueError:
            raise ValueError(f"--split {a.split!r}: want three integers PARTS,PAIRS,ROWS, e.g. 4,48,256") from None
    elif rec.row_split > 1:
        parts, seg, rows = rec.row_split, rec.row_split_pairs, rec.row_split_rows
    else:
        parts, seg, rows = 4, 48, 256
    for spec in a.activity:
        for m in a.M:
            p = make_ffn_for(spec, m, a.K, a.N, a.density, gated=True, dtype=torch.float32, device="cpu", seed=1)
            cnt = (F.linear(p["x"], p["w_gate"], p.get("b_gate")) > 0).sum(1)
            width = select.list_width(rec, a.N, float(cnt.float().mean()))
            pairs = cnt.clamp(max=width).tolist()
            q = torch.quantile(cnt.float(), torch.tensor([0.5, 0.99])).tolist()
            row = dict(activity=spec, M=m, width=width, mean=round(float(cnt.float().mean()), 1), p50=q[0], p99=q[1],
                       max=int(cnt.max()), split=[parts, seg, min(rows, m)])
            for s in a.slots:
                row[f"stretch_{s}"] = round(stretch(pairs, s, a.overhead), 2)
                row[f"split_stretch_{s}"] = round(stretch(pairs, s, a.overhead, parts, seg, min(rows, m)), 2)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
