# Session 11 run 9 (H200; run 8 failed: HF CompileConfig default mode next to twell options): generate() compiled in torch.compile's default mode (no CUDA graphs
# around the step): Inductor vs twell with the decode FFNs rewritten (twell.cudagraphs=on
# overrides the compile rule that leaves them to Inductor without graphs), batch 1 and 8; the op
# replays its own graphs (decode_graphs.py). Then the same with those off (TWELL_DECODE_GRAPHS=0).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run9
for b in 1 8; do
  timeout 150 python3 benchmarks/bench_e2e.py --generate --compile-mode default --twell-opt twell.cudagraphs=on \
    --batch $b --seq 128 --new-tokens 64 --density 0.005 --no-energy --reps 3 --out $OUT/run9/e2e_default_b$b.json > $OUT/run9/e2e_default_b$b.log 2>&1
  grep "decode tokens\|decode  " $OUT/run9/e2e_default_b$b.log
done
TWELL_DECODE_GRAPHS=0 timeout 150 python3 benchmarks/bench_e2e.py --generate --compile-mode default --twell-opt twell.cudagraphs=on \
  --batch 1 --seq 128 --new-tokens 64 --density 0.005 --no-energy --reps 3 --backends twell --out $OUT/run9/e2e_default_b1_nographs.json > $OUT/run9/e2e_default_b1_nographs.log 2>&1
grep "decode tokens\|decode  " $OUT/run9/e2e_default_b1_nographs.log
