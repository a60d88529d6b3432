"""Session 13 probe (H200): software-pipelined pair trips in the decode pairs form.

A program's active pairs go PB = 4 at a time, one memory round trip each (W_up, W_d^T and x
rows requested together, then u, h and the atomics); at M=16 d=0.005 the busiest programs
take 2 trips, and session 12 put the up projection at 5.5 us of 19.6. The trips' addresses
come from the gate's ranks, not from loaded data, so the next trip's gathers can be issued
before this trip's arithmetic: ``tl.range(..., num_stages=S)`` on the trip loop (the inner
K and K_out loops flattened, valid for K = K_out = KC = KOC = 2048 only, as here). Also PB=2
(more, lighter trips). K=2048 N=5632 d=0.005, variants from the source at run time
(variants.py). Prints JSON lines, writes argv[1].

    python3 benchmarks/results/h200/session13/probe_pipe.py OUT.json
"""
import inspect
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "session9"), str(Path(__file__).resolve().parent)]
from variants import module, time_variants  # noqa: E402  (puts the repo root and benchmarks/ on sys.path)

from twell_compile.kernels import cuda_decode, twell_decode_list  # noqa: E402

LSRC = inspect.getsource(twell_decode_list)
FLAT = [("                for k0 in range(0, K, KC):\n", "                k0 = 0\n                if True:\n"),
        ("    for o0 in range(KOC, KO, KOC):\n", "    o0 = KOC\n    if False:\n")]
TRIPS = "        for p0 in range(0, npair, PB):\n"
shipped = (twell_decode_list.decode_pairs_kernel, None)
VARIANTS = {"shipped": shipped, "flat": (module("flat", LSRC, FLAT).decode_pairs_kernel, None)}
for s in (2, 3):
    VARIANTS[f"pipe{s}"] = (module(f"pipe{s}", LSRC, FLAT + [(TRIPS, TRIPS.replace(
        "range(0, npair, PB)", f"tl.range(0, npair, PB, num_stages={s})"))]).decode_pairs_kernel, None)
VARIANTS["pb2"] = (shipped[0], 2)
VARIANTS["pipe2/pb2"] = (VARIANTS["pipe2"][0], 2)
base = dict(cuda_decode.CONFIGS)


def use(v):
    twell_decode_list.decode_pairs_kernel = v[0]
    cuda_decode.CONFIGS.update(base if v[1] is None else {mp: c._replace(pb=v[1]) for mp, c in base.items()})
    cuda_decode._prepared.clear()


time_variants(VARIANTS, use, ((16, "pairs"), (8, "pairs")))
