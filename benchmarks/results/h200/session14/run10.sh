#!/usr/bin/env bash
# Session 14 run 10: bench_e2e generate() and the step loop at batch 8 and 16 (the pairs form's
# new config runs the decode FFNs there).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run10
for b in 8 16; do
  rm -rf /tmp/torchinductor_root
  timeout 270 python3 benchmarks/bench_e2e.py --generate --step-loop --batch $b --seq 128 --new-tokens 128 \
    --density 0.005 --no-energy --out $OUT/run10/e2e_generate_b$b.json > $OUT/run10/e2e_b$b.log 2>&1
  grep "step loop\|decode \|twell /" $OUT/run10/e2e_b$b.log | cut -c1-140
done
