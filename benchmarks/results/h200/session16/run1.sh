#!/bin/bash
# Session 16 run 1: the training GPU tests on session 15's final launch configs; the small-M
# host probe of the training op.
R=${OUT:-/tmp}/run1
. benchmarks/results/h200/session15/lib.sh
setup
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $R/gpu.txt
timeout 420 python3 -m pytest -q -x tests/kernels/test_cuda_train.py > $R/pytest_cuda_train.log 2>&1
echo "rc=$?" >> $R/pytest_cuda_train.log
tail -3 $R/pytest_cuda_train.log
timeout 150 python3 benchmarks/results/h200/session16/probe_train_small.py 1024 > $R/probe_train_small.log 2>&1
echo "rc=$?" >> $R/probe_train_small.log
grep -E "^M=|rc=" $R/probe_train_small.log
