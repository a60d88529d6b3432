#!/bin/bash
# Session 17 run 1: build csrc/twell_down.cu, the GPU inference tests on the split path, the
# probe of the split against the fused row kernel.
R=${R:-${OUT:-/tmp}/run1}
source benchmarks/results/h200/session15/lib.sh
setup
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$R/gpu.txt"
timeout 300 python3 benchmarks/results/h200/session17/probe_down.py "$R/probe_down.json" > "$R/probe_down.log" 2>&1
echo "rc=$?" >> "$R/probe_down.log"
cat "$R/probe_down.log"
timeout 200 python3 -m pytest -q -x tests/kernels/test_cuda_ffn.py > "$R/test_cuda_ffn.log" 2>&1
echo "rc=$?" >> "$R/test_cuda_ffn.log"
tail -15 "$R/test_cuda_ffn.log"
