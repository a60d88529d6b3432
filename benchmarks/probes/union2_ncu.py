"""The union2 decode form's launches, for Nsight Compute (nothing is timed here): four eager calls
of the form at M rows (K=2048, N=5632, K_out=2048, bf16, d=0.005, W_down stored transposed), with
the record's config for M and the fields given as JSON replaced, so ncu can skip the first three.

    TWELL_PDL=0 ncu --clock-control none -k regex:union2_up --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy --section SchedulerStats \\
        python3 benchmarks/probes/union2_ncu.py 64 '{"u2_sk": 4}'

(docs/design-notes/decode.md "The union2 form" gives one such run's numbers.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from twell_compile.runtime import decode_state  # noqa: E402
from twell_compile.runtime.cuda_decode import config_for, decode_forward  # noqa: E402
from twell_compile.testing import make_ffn  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("m", type=int, help="tokens per call (decode sizes)")
    ap.add_argument("fields", nargs="?", default="{}", help='config fields to replace, JSON, e.g. {"u2_sk": 4}')
    a = ap.parse_args(argv)
    fields = json.loads(a.fields)
    if not isinstance(fields, dict):
        raise ValueError(f"fields must be a JSON object of config fields, e.g. '{{\"u2_sk\": 4}}', got {a.fields!r}")
    p = make_ffn(a.m, 2048, 5632, 0.005, device="cuda")
    wd = p["w_down"].t().contiguous().t()             # stored [N, K_out], as prepare(down_layout="transposed")
    decode_state.register(wd)
    cfg = config_for(a.m, 2048, p["x"].device)._replace(**fields)
    for _ in range(4):
        decode_forward(p["x"], p["w_gate"], None, p["w_up"], None, wd, None, cfg=cfg, form="union2")
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
