#!/bin/bash
# Session 18 run 1: the floors of row-gathering sparse FFNs (bench_floor.py), the GPU kernel
# tests on HEAD (session 17's last commits never ran on a GPU), the product grid at M=16384.
R=${R:-${OUT:-/tmp}/run1}
source benchmarks/results/h200/session15/lib.sh
setup
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$R/gpu.txt"; cat "$R/gpu.txt"
PYTHONUNBUFFERED=1 timeout 240 python3 benchmarks/bench_floor.py --out "$R/floor.json" > "$R/bench_floor.log" 2>&1
echo "rc=$?" >> "$R/bench_floor.log"; grep -v Warning "$R/bench_floor.log" | tail -12
timeout 200 python3 -m pytest -q -x tests/kernels/test_cuda_ffn.py tests/kernels/test_cuda_train.py > "$R/pytest_cuda.log" 2>&1
echo "rc=$?" >> "$R/pytest_cuda.log"; tail -3 "$R/pytest_cuda.log"
PYTHONUNBUFFERED=1 timeout 100 python3 benchmarks/bench_ffn.py --shapes 2048x5632 --M 16384 --reps 50 \
  --out "$R/ffn_inference_16384.json" > "$R/bench_ffn_16384.log" 2>&1
echo "rc=$?" >> "$R/bench_ffn_16384.log"; grep -v Warning "$R/bench_ffn_16384.log" | tail -14
