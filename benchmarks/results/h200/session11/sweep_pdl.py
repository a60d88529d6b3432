"""Session 11 sweep (H200): the decode pairs form's launch configs with programmatic dependent
launch on (the default since this session), K=2048 N=5632 d=0.005, M=16 and 8, CUDA graph over
several layers (as bench_decode). Prints JSON lines, writes argv[1].

    python3 benchmarks/results/h200/session11/sweep_pdl.py OUT.json
"""
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "session9"))
from probe_io import decode_sweep  # noqa: E402  (puts the repo root and benchmarks/ on sys.path)

decode_sweep({f"lbn{lbn}/lbk{lbk}/st{lst}/w{warps}": dict(lbn=lbn, lbk=lbk, lstages=lst, warps=warps)
              for lbn, (lbk, lst), warps in itertools.product(
                  (32, 16, 64), ((128, 5), (128, 6), (128, 8), (256, 3), (256, 4), (64, 8)), (4, 8))})
