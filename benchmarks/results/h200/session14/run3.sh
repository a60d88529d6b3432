#!/usr/bin/env bash
# Session 14 run 3: at lbn 16, pb 2 (run 2's best at M=16), the gate's K step, stages, warps.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run3
timeout 400 python3 benchmarks/results/h200/session14/sweep_pairs_trip.py $OUT/run3/sweep.json gate 16 8 \
  > $OUT/run3/sweep.log 2>&1
grep BEST $OUT/run3/sweep.log; tail -2 $OUT/run3/sweep.log | cut -c1-300
