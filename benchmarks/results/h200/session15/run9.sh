#!/bin/bash
# Session 15 run 9: bench_e2e --train (16-layer Llama, AdamW, bf16 autocast, 20 steps,
# Inductor vs twell) on session 15's kernels.
SKIP_TESTS=1 SKIP_PARTS=1 SKIP_GRID=1 T_E2E=500 TAG=run9_ bash benchmarks/run_train_gpu.sh
