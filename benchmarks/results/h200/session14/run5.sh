#!/usr/bin/env bash
# Session 14 run 5: the decode grid with the new pairs config (lbn 16, pb 2, 2 warps) under the
# old rule; the rule refitted to it (tune_decode.py --fit-from, apply_fit.py); the grid again.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run5
timeout 250 python3 benchmarks/bench_ffn.py --decode --reps 40 --out $OUT/run5/grid1.json > $OUT/run5/grid1.log 2>&1
tail -1 $OUT/run5/grid1.log
python3 benchmarks/tune_decode.py --fit-from $OUT/run5/grid1.json --policy-out $OUT/run5/fit1.json
python3 benchmarks/results/h200/session14/apply_fit.py $OUT/run5/fit1.json
cp twell_compile/kernels/cuda_policy.py $OUT/run5/cuda_policy_fit1.py
timeout 250 python3 benchmarks/bench_ffn.py --decode --reps 40 --out $OUT/run5/grid2.json > $OUT/run5/grid2.log 2>&1
tail -1 $OUT/run5/grid2.log
grep -E "^ *(1|16) .*0.005" $OUT/run5/grid2.log | head -4
