#!/bin/bash
# Session 15 run 7: the refitted density rule (PAIR_UNITS by L2 residency). Inference grid at
# M >= 16384 (both shapes; the op's own choice now), CUDA inference tests and the compile-level
# ones, then bench_e2e --forward (batch 8 x 2048, d = 0.005 and 0.02).
R="$OUT/run7"; source benchmarks/results/h200/session15/lib.sh; setup
infer_grid 150 " .* (0.005|0.01) "
rm -rf /tmp/torchinductor_root
timeout 150 python3 -m pytest -q -x tests/kernels/test_cuda_ffn.py tests/kernels/test_cuda_policy.py tests/test_dispatch.py tests/test_modes.py > "$R/tests.log" 2>&1
tail -2 "$R/tests.log"
timeout 240 python3 benchmarks/bench_e2e.py --forward --density 0.005 0.02 --out "$R/e2e_forward.json" > "$R/e2e_forward.log" 2>&1
echo "rc=$?" >> "$R/e2e_forward.log"; grep -v Warn "$R/e2e_forward.log" | tail -12
