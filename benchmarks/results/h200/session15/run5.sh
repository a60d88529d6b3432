#!/bin/bash
# Session 15 run 5: the inference rows kernel with PF=2 (next weight rows one step ahead, now
# that a step holds one pair), then the inference grid at M >= 16384 for both shapes.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
R="$OUT/run5"; mkdir -p "$R"
(cd benchmarks && PROBE_ONLY=twell_rows_kernel timeout 100 python3 results/h200/session15/probe_rows.py > "$R/probe_rows_pf2.log" 2>&1)
grep -E "PAIRS': 1|best" "$R/probe_rows_pf2.log"
for s in 2048x5632 4096x11008; do
  timeout 240 python3 benchmarks/bench_ffn.py --shapes $s --M 16384 65536 --reps 50 \
    --out "$R/ffn_inference_$s.json" > "$R/bench_ffn_$s.log" 2>&1
  echo "rc=$?" >> "$R/bench_ffn_$s.log"
  grep -E "^ +(16384|65536)|rc=" "$R/bench_ffn_$s.log"
done
