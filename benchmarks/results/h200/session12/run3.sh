#!/usr/bin/env bash
# Session 12 run 3: bench_e2e generate + step loop (now with untimed warm steps per round), batch 1 and 8.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
for b in 1 8; do
  timeout 170 python3 benchmarks/bench_e2e.py --generate --step-loop --batch $b --seq 128 --new-tokens 128 \
    --density 0.005 --no-energy --out $OUT/e2e_generate_b$b.json > $OUT/e2e_b$b.log 2>&1
  grep "step-loop\|decode tokens\|step loop" $OUT/e2e_b$b.log
done
