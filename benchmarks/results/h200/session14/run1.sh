#!/usr/bin/env bash
# Session 14 run 1: the pairs form's gate sweep (sweep_pairs_gate.py) at M=16, 8, 4, 2.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/run1/gpu.txt
timeout 550 python3 benchmarks/results/h200/session14/sweep_pairs_gate.py $OUT/run1/sweep.json 16 8 4 2 \
  > $OUT/run1/sweep.log 2>&1
grep BEST $OUT/run1/sweep.log; tail -3 $OUT/run1/sweep.log
