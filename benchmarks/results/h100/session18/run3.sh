#!/bin/bash
# Session 18 run 3: bench_floor.py (floors of row-gathering sparse FFNs) and issue 3's grid for
# K=2048, N=5632 with the product as twell_ms (bench_ffn.py), on whichever GPU the call got.
R=${R:-${OUT:-/tmp}/run3}
source benchmarks/results/h200/session15/lib.sh
setup
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$R/gpu.txt"; cat "$R/gpu.txt"
PYTHONUNBUFFERED=1 timeout 200 python3 benchmarks/bench_floor.py --out "$R/floor.json" > "$R/bench_floor.log" 2>&1
echo "rc=$?" >> "$R/bench_floor.log"; grep -v -E "Warn|return Var" "$R/bench_floor.log" | tail -8
PYTHONUNBUFFERED=1 timeout 360 python3 benchmarks/bench_ffn.py --shapes 2048x5632 --reps 50 \
  --out "$R/ffn_inference_2048x5632.json" > "$R/bench_ffn.log" 2>&1
echo "rc=$?" >> "$R/bench_ffn.log"; grep -v Warn "$R/bench_ffn.log" | tail -62
