#!/bin/bash
# Session 18 run 2: the sorted wgrad order (probe_sort.py: backward times, sorted vs not, wgrad
# configs), the training GPU tests on it, the training grid's target points.
R=${R:-${OUT:-/tmp}/run2}
source benchmarks/results/h200/session15/lib.sh
setup
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$R/gpu.txt"; cat "$R/gpu.txt"
PYTHONUNBUFFERED=1 timeout 200 python3 benchmarks/results/h100/session18/probe_sort.py "$R/probe_sort.json" > "$R/probe_sort.log" 2>&1
echo "rc=$?" >> "$R/probe_sort.log"; grep -v Warn "$R/probe_sort.log" | tail -8
timeout 150 python3 -m pytest -q -x tests/kernels/test_cuda_train.py > "$R/pytest_cuda_train.log" 2>&1
echo "rc=$?" >> "$R/pytest_cuda_train.log"; tail -2 "$R/pytest_cuda_train.log"
PYTHONUNBUFFERED=1 timeout 200 python3 benchmarks/bench_ffn_train.py --M 16384 65536 --density 0.005 0.02 --tail 0 0.2 --reps 50 \
  --out "$R/ffn_training.json" > "$R/bench_ffn_train.log" 2>&1
echo "rc=$?" >> "$R/bench_ffn_train.log"; grep -v Warn "$R/bench_ffn_train.log" | tail -10
