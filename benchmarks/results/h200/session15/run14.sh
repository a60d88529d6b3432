#!/bin/bash
# Session 15 run 14: bench_e2e --train with the penalty (twell.l1=12, as session 7's run 17),
# on session 15's kernels.
SKIP_TESTS=1 SKIP_PARTS=1 SKIP_GRID=1 T_E2E=500 TAG=run14_ E2E_ARGS="--twell-opt twell.l1=12" \
  bash benchmarks/run_train_gpu.sh
