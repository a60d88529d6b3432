"""Session 13 probe (H200): is the statistics sum what makes finer neuron blocks slow?

probe_gemv.py (run 3): the rows form with a whole-row GEMV gate took 19.0 us at BN=4 (1408
programs) against 15.4 shipped (BN=32, 176), though probe_read.py reads 23 MB 1.6 us faster
with 1408 programs. The finishing launch's last program sums non-zeros per (block, row) over
every block, 256 blocks per step: 6 dependent steps at 1408 blocks, 1 at 176. Here the same
variants with a finish that sums only the first block's statistics ("nostats": y exact, the
statistics wrong; timing only), and the pairs form at M=8/16 with 16 neurons per program.
Variants from the source at run time (variants.py, probe_gemv.py). Prints JSON lines,
writes argv[1].

    python3 benchmarks/results/h200/session13/probe_stats.py OUT.json
"""
import inspect
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "session9"), str(Path(__file__).resolve().parent)]
from variants import module, time_variants  # noqa: E402  (puts the repo root and benchmarks/ on sys.path)
from probe_gemv import GATE_ROWS, GEMV  # noqa: E402

from twell_compile.kernels import cuda_decode, twell_decode  # noqa: E402

SUM = "        _finish_stats(rc_ptr, hs_ptr, tok_ptr, hsum_ptr, st_ptr, M, NB, NRB, HAS_ST, MB, RB)\n"
NOSTATS = [(SUM, SUM.replace("M, NB, NRB", "M, 1, NRB"))]
src = inspect.getsource(twell_decode)
gemv = module("gemv", src, GEMV, GATE_ROWS)
gemv_ns = module("gemv_ns", src, GEMV + NOSTATS, GATE_ROWS)
ns = module("ns", src, NOSTATS)
shipped = (twell_decode.decode_fused_kernel, twell_decode.decode_finish_kernel)
base = dict(cuda_decode.CONFIGS)
VARIANTS = {"shipped": (shipped, {}), "nostats": ((shipped[0], ns.decode_finish_kernel), {})}
for bn in (4, 8, 16):
    VARIANTS[f"gemv/bn{bn}"] = ((gemv.decode_fused_kernel, shipped[1]), dict(bn=bn))
    VARIANTS[f"gemv/bn{bn}/nostats"] = ((gemv_ns.decode_fused_kernel, gemv_ns.decode_finish_kernel), dict(bn=bn))
for lbn in (16, 32):
    VARIANTS[f"lbn{lbn}/nostats"] = ((shipped[0], ns.decode_finish_kernel), dict(lbn=lbn))
VARIANTS["lbn16"] = (shipped, dict(lbn=16))


def use(v):
    twell_decode.decode_fused_kernel, twell_decode.decode_finish_kernel = v[0]
    cuda_decode.CONFIGS.update({mp: c._replace(**v[1]) for mp, c in base.items()})
    cuda_decode._prepared.clear()


rows = {k: v for k, v in VARIANTS.items() if not k.startswith("lbn")}
pairs = {k: v for k, v in VARIANTS.items() if k in ("shipped", "nostats") or k.startswith("lbn")}
time_variants(rows, use, ((1, "rows"),), reps=2)
time_variants(pairs, use, ((16, "pairs"), (8, "pairs")), reps=2)
