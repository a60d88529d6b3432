#!/bin/bash
# Session 15 run 1: the weight-gradient passes' prefetch (WG_PF). Training GPU tests, then the
# sparse path's stage times for 5 kernel configs (M=16384 d=0.005 tail 0) and its profile.
SKIP_GRID=1 SKIP_E2E=1 TAG=run1_ bash benchmarks/run_train_gpu.sh
