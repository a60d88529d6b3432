# Session 11 run 11 (H200): the K=4096 M=1 d=0.2 anomaly of run 10 (probe_tiles.py), then the
# K=4096 M=1/64 grid rows again with the dense path graphed only where host-bound.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run11
timeout 150 python3 benchmarks/results/h200/session11/probe_tiles.py $OUT/run11/probe_tiles.txt 2>&1 | grep -v "^-\|Warn" | head -60
timeout 240 python3 benchmarks/bench_ffn.py --M 1 64 --shapes 4096x11008 --reps 50 --out $OUT/run11/ffn_small.json > $OUT/run11/grid_small.log 2>&1
tail -26 $OUT/run11/grid_small.log | awk '{print $1,$4,$5,$9,$10,$12,$14,$NF}'
