#!/usr/bin/env bash
# Session 14 run 4: the candidate pairs configs at M = 16, 8, 4, 2, 5 interleaved reps.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run4
REPS=5 timeout 400 python3 benchmarks/results/h200/session14/sweep_pairs_trip.py $OUT/run4/sweep.json final 16 8 4 2 \
  > $OUT/run4/sweep.log 2>&1
grep BEST $OUT/run4/sweep.log; tail -2 $OUT/run4/sweep.log | cut -c1-300
