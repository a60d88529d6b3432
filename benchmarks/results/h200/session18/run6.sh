#!/bin/bash
# Session 18 run 6: GPU tests on the final code (weight_cache entries now die with their
# parameter): generate, decode graphs, modes, the CUDA inference tests, dispatch, recompiles,
# the weight cache; then the decode kernels' own tests.
R=${R:-${OUT:-/tmp}/run6}
source benchmarks/results/h200/session15/lib.sh
setup
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$R/gpu.txt"; cat "$R/gpu.txt"
timeout 330 python3 -m pytest -q tests/test_generate.py tests/kernels/test_decode_graphs.py tests/test_modes.py \
  tests/kernels/test_cuda_ffn.py tests/test_dispatch.py tests/models/test_recompiles.py tests/kernels/test_weight_cache.py \
  > "$R/pytest_compile.log" 2>&1
echo "rc=$?" >> "$R/pytest_compile.log"; tail -3 "$R/pytest_compile.log"
timeout 230 python3 -m pytest -q -x tests/kernels/test_decode.py > "$R/pytest_decode.log" 2>&1
echo "rc=$?" >> "$R/pytest_decode.log"; tail -3 "$R/pytest_decode.log"
