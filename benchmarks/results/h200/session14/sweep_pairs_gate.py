"""Session 14 sweep: the pairs form's gate at M = 2..16 (K=2048 N=5632 d=0.005), where M=16
stands at 19.5 us against the 19.0 that 1.8x over dense needs. The tl.dot gate's neurons per
program (lbn), K step (lbk), stages and warps, the pairs per trip (pb), and the whole-row GEMV
gate (pgemv_bn neurons per program, new this session). Each config is checked against fp64
under the 2x rule, then timed over rotated layers in one CUDA graph (session9/probe_io).

    python3 benchmarks/results/h200/session14/sweep_pairs_gate.py OUT.json [M ...]
"""
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "session9"))
from probe_io import decode_sweep  # noqa: E402  (puts the repo root and benchmarks/ on sys.path)

cfgs = {f"lbn{b}/lbk{k}/s{s}/w{w}": dict(lbn=b, lbk=k, lstages=s, warps=w)
        for b, k, s, w in itertools.product((16, 32), (64, 128, 256), (3, 4, 5), (4, 8))}
cfgs.update({f"lbn{b}/pb{pb}": dict(lbn=b, pb=pb) for b, pb in itertools.product((16, 32), (2, 8))})
cfgs.update({f"gemv{b}/w{w}": dict(pgemv_bn=b, pgemv_m=16, warps=w)
             for b, w in itertools.product((2, 4, 8, 16), (2, 4, 8))})
ms = tuple(int(v) for v in sys.argv[2:]) or (16, 8, 4, 2)
decode_sweep(cfgs, ms=ms)
