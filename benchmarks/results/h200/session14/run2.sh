#!/usr/bin/env bash
# Session 14 run 2: pairs per trip, gather chunks, lbn and stages, interleaved (sweep_pairs_trip.py).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run2
timeout 560 python3 benchmarks/results/h200/session14/sweep_pairs_trip.py $OUT/run2/sweep.json 16 8 4 2 \
  > $OUT/run2/sweep.log 2>&1
grep BEST $OUT/run2/sweep.log; tail -2 $OUT/run2/sweep.log | cut -c1-2000
