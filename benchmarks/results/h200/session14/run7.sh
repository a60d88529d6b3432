#!/usr/bin/env bash
# Session 14 run 7: the grid under the rule refitted to run 6's grid (per-form weights:
# tune_decode.WEIGHT_POWER), bench_e2e at batch 1, the compile-level tests.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run7
timeout 200 python3 benchmarks/bench_ffn.py --decode --reps 40 --out $OUT/run7/ffn_decode.json > $OUT/run7/grid.log 2>&1
tail -1 $OUT/run7/grid.log
grep -E "^ *(1|2|4|8|16) +2048 .*0.005" $OUT/run7/grid.log
rm -rf /tmp/torchinductor_root
timeout 200 python3 benchmarks/bench_e2e.py --generate --step-loop --batch 1 --seq 128 --new-tokens 128 \
  --density 0.005 --no-energy --out $OUT/run7/e2e_generate_b1.json > $OUT/run7/e2e_b1.log 2>&1
grep "step-loop\|decode tokens\|step loop" $OUT/run7/e2e_b1.log
rm -rf /tmp/torchinductor_root
timeout 150 python3 -m pytest -q tests/test_dispatch.py tests/test_modes.py tests/test_generate.py > $OUT/run7/tests.log 2>&1
tail -2 $OUT/run7/tests.log
