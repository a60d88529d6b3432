#!/usr/bin/env bash
# Session 14 run 8: the grid under the rule refitted to run 7's grid with tiles' atomics term
# (cuda_policy.tiles_active) and least relative error for every form.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run8
timeout 200 python3 benchmarks/bench_ffn.py --decode --reps 40 --out $OUT/run8/ffn_decode.json > $OUT/run8/grid.log 2>&1
tail -1 $OUT/run8/grid.log
grep -E "^ *(1|2|4|8|16) +2048 .*0.005" $OUT/run8/grid.log
python3 benchmarks/tune_decode.py --fit-from $OUT/run8/ffn_decode.json --policy-out $OUT/run8/fit.json
