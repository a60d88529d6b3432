#!/bin/bash
# Session 15 run 17: final training configs (wgrad back to session 14's): the 30-point training
# grid, then bench_e2e --train with twell.l1=12 (Inductor and twell).
SKIP_TESTS=1 SKIP_PARTS=1 POINTS=full T_GRID=150 T_E2E=250 TAG=run17_ E2E_ARGS="--twell-opt twell.l1=12 --no-energy" \
  bash benchmarks/run_train_gpu.sh
