"""Session 13 probe (H200): a finer-grained gate for the rows form (M <= 4).

The rows form's gate is tl.dot over rows padded to 16, BN = 32 neurons per program: 176
programs at N=5632. probe_read.py (run 2) read the same 23 MB in 11.1 us with 176 programs
and 9.5 us with 1408 (PDL, one CUDA graph over rotated buffers). Here the gate is a plain
GEMV: each program loads its BN whole W_gate rows in one request ([BN, K] at once: one round
trip) and the x rows, g by FMA in fp32 (no row padding), then the shipped per-neuron
up/down; BN = 4..32, 4 or 8 warps, M = 1, 2, 4, pairs of the shipped rows form in the same
run. Variants from the source at run time (variants.py). Prints JSON lines, writes argv[1].

    python3 benchmarks/results/h200/session13/probe_gemv.py OUT.json
"""
import inspect
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "session9"), str(Path(__file__).resolve().parent)]
from variants import module, time_variants  # noqa: E402  (puts the repo root and benchmarks/ on sys.path)

from twell_compile.kernels import cuda_decode, twell_decode  # noqa: E402

GATE_ROWS = '''

@triton.jit
def _gate_rows(x_ptr, sx_m, sx_k, wg_ptr, swg_n, swg_k, bg_ptr, rn, n_ok, rm, m_ok, M, K,
               HAS_BG: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr, MS: tl.constexpr, KP: tl.constexpr):
    rk = tl.arange(0, KP)
    k_ok = rk < K
    w = tl.load(wg_ptr + rn.to(tl.int64)[:, None] * swg_n + rk[None, :] * swg_k,
                mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    g = tl.zeros((MB, BN), dtype=tl.float32)
    for m in tl.static_range(MS):
        xm = tl.load(x_ptr + m * sx_m + rk * sx_k, mask=k_ok & (m < M), other=0.0).to(tl.float32)
        g = tl.where((rm == m)[:, None], tl.sum(w * xm[None, :], axis=1)[None, :], g)
    if HAS_BG:
        g += tl.load(bg_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    valid = m_ok[:, None] & n_ok[None, :]
    v = tl.where(g < 0.0, 0.0, g)
    nz = (v != 0.0) & valid
    act = (nz | ~(tl.abs(g) < float("inf"))) & valid
    return v, nz, act
'''
CALL = ("    v, nz, act = _gate_block(xbase, sx_k, wg_ptr, swg_n, swg_k, bg_ptr, rn, n_ok, m_ok, K,\n"
        "                                HAS_BG, MB, BN, BK)\n")
GEMV = [(CALL, ("    v, nz, act = _gate_rows(x_ptr, sx_m, sx_k, wg_ptr, swg_n, swg_k, bg_ptr, rn, n_ok, rm, m_ok, M, K,\n"
                 "                            HAS_BG, MB, BN, MS, KP)\n"))]
shipped = twell_decode.decode_fused_kernel
base = dict(cuda_decode.CONFIGS)


def use(v):
    twell_decode.decode_fused_kernel = v[0]
    cuda_decode.CONFIGS.update({mp: c._replace(**v[1]) for mp, c in base.items()})
    cuda_decode._prepared.clear()


if __name__ == "__main__":
    gemv = module("gemv", inspect.getsource(twell_decode), GEMV, GATE_ROWS).decode_fused_kernel
    VARIANTS = {"shipped": (shipped, {})}
    for bn in (4, 8, 16, 32):
        for warps in (4, 8):
            VARIANTS[f"gemv/bn{bn}/w{warps}"] = (gemv, dict(bn=bn, warps=warps))
    time_variants(VARIANTS, use, ((1, "rows"), (2, "rows"), (4, "rows")), reps=2)
