"""The four kernels of the fused gate GEMM's parts, for Nsight Compute (nothing is timed here):
CUTLASS's own GEMM at configuration 2's tile (benchmarks/probes/cutlass_gemm*.cu), then
twell::gate_pack writing g alone, packing alone, and both; three rounds, so ncu can skip the
first two (builds and warm-up). bf16, K=2048, N=5632, d=0.005, M=16384.

    ncu --clock-control none -k regex:device_kernel --launch-skip 8 --launch-count 4 \\
        --metrics gpu__time_duration.sum,sm__inst_executed.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum,\\
lts__t_sectors_op_write.sum python3 benchmarks/probes/gate_ncu.py

(results/h200/gate_ncu.json holds one such run.)
"""

import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from twell_compile.build import PROBES, load  # noqa: E402
from twell_compile.runtime import cuda_gate  # noqa: E402
from twell_compile.testing import make_ffn  # noqa: E402

CFG, RASTER = 2, 2


def main() -> int:
    p = make_ffn(16384, 2048, 5632, 0.005, 0.0)
    x, w = p["x"], p["w_gate"]
    probe = load("cutlass_gemm", directory=PROBES)
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    for _ in range(3):
        probe.gemm(x, w, out, CFG, RASTER, 1)
        cuda_gate.gate_pack(x, w, None, CFG, 0, RASTER, 1)                 # g alone
        cuda_gate.gate_pack(x, w, None, CFG, 16, RASTER, 1, g="none")     # packing alone
        cuda_gate.gate_pack(x, w, None, CFG, 16, RASTER, 1)                # both
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
