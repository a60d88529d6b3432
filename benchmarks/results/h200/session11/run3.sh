# Session 11 run 3 (H200): the full decode grid with PDL (issue 7 item 3), then generate() and
# the compiled step loop at batch 1 (issue 7 item 4).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run3
timeout 220 python3 benchmarks/bench_ffn.py --decode --reps 40 --out $OUT/run3/ffn_decode.json > $OUT/run3/grid.log 2>&1
tail -3 $OUT/run3/grid.log
timeout 340 python3 benchmarks/bench_e2e.py --generate --step-loop --batch 1 --seq 128 --new-tokens 128 \
  --density 0.005 --no-energy --out $OUT/run3/e2e_generate_b1.json > $OUT/run3/e2e_b1.log 2>&1
tail -12 $OUT/run3/e2e_b1.log
