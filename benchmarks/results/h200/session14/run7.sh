#!/usr/bin/env bash
# Session 14 run 7: the grid under the rule refitted to run 6's grid (per-form weights:
# tune_decode.WEIGHT_POWER), bench_e2e at batch 1, the compile-level tests.
. benchmarks/results/h200/session14/lib.sh
RUN=run7
setup
grid ffn_decode grid
rm -rf /tmp/torchinductor_root
timeout 200 python3 benchmarks/bench_e2e.py --generate --step-loop --batch 1 --seq 128 --new-tokens 128 \
  --density 0.005 --no-energy --out $OUT/run7/e2e_generate_b1.json > $OUT/run7/e2e_b1.log 2>&1
grep "step-loop\|decode tokens\|step loop" $OUT/run7/e2e_b1.log
rm -rf /tmp/torchinductor_root
timeout 150 python3 -m pytest -q tests/test_dispatch.py tests/test_modes.py tests/test_generate.py > $OUT/run7/tests.log 2>&1
tail -2 $OUT/run7/tests.log
