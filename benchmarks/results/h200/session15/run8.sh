#!/bin/bash
# Session 15 run 8: the full 30-point training grid on session 15's kernels (row kernels by
# width, wgrad configs, rows over W first).
SKIP_TESTS=1 SKIP_PARTS=1 SKIP_E2E=1 POINTS=full T_GRID=420 TAG=run8_ bash benchmarks/run_train_gpu.sh
