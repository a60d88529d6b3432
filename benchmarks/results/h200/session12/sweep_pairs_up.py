"""Session 12 sweep, for the next device session (not run yet): the pairs form's up
projection, which probe_parts.py measured at 5.5 us of M=16's 19.6 (one memory round trip per
PB pairs; a program holds up to ~8 pairs at M=16, d=0.005, so two trips at PB=4). Pairs per
trip (pb), the K chunk of its gathers (kc), the W_d^T chunk requested with them (koc) and
warps, at K=2048 N=5632 d=0.005, M=16 and 8 (session9/probe_io.decode_sweep). Prints JSON
lines, writes argv[1].

    python3 benchmarks/results/h200/session12/sweep_pairs_up.py OUT.json
"""
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "session9"))
from probe_io import decode_sweep  # noqa: E402  (puts the repo root and benchmarks/ on sys.path)

decode_sweep({f"pb{pb}/kc{kc}/koc{koc}/w{warps}": dict(pb=pb, kc=kc, koc=koc, warps=warps)
              for pb, kc, koc, warps in itertools.product((4, 8, 16), (2048, 1024, 512), (2048, 1024), (4, 8))})
