# Session 11 run 10 (H200): the issue-3 grid rows at M = 1 and 64 for K=4096, N=11008 with the
# op's own graphs (run 7 did K=2048).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run10
timeout 300 python3 benchmarks/bench_ffn.py --M 1 64 --shapes 4096x11008 --reps 50 --out $OUT/run10/ffn_small.json > $OUT/run10/grid_small.log 2>&1
tail -27 $OUT/run10/grid_small.log
