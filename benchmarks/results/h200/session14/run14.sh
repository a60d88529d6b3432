#!/usr/bin/env bash
# Session 14 run 14: the list form back at its own config (lbn 32, pb 4, 4 warps; the pairs form
# keeps 16 / 2 / 2 through Config.pbn/ppb/pwarps): the grid under the rule of run 8's fit, its refit.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run14
timeout 200 python3 benchmarks/bench_ffn.py --decode --reps 40 --out $OUT/run14/ffn_decode.json > $OUT/run14/grid.log 2>&1
tail -1 $OUT/run14/grid.log
grep -E "^ *(1|2|4|8|16) +2048 .*0.005" $OUT/run14/grid.log
python3 benchmarks/tune_decode.py --fit-from $OUT/run14/ffn_decode.json --policy-out $OUT/run14/fit.json
timeout 200 python3 -m pytest -q tests/kernels/test_decode.py -k "list or pairs or deterministic or form" > $OUT/run14/tests.log 2>&1
tail -2 $OUT/run14/tests.log
