# Session 11 run 13 (H200): the issue-3 grid rows at M = 1 and 64, both shapes, with the final
# code (dense path graphed where its predicted GPU time is under 100 us).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run13
timeout 400 python3 benchmarks/bench_ffn.py --M 1 64 --reps 50 --out $OUT/run13/ffn_small.json > $OUT/run13/grid_small.log 2>&1
grep -E "^ +(1|64) " $OUT/run13/grid_small.log | awk '{print $1,$2,$4,$5,$9,$10,$12,$14,$NF}'
