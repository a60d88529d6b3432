#!/bin/bash
# Session 17: issue 3's whole inference grid for one shape (SHAPE=KxN), interleaved timing and
# the compiled module as twell_ms (bench_ffn.py of this session), into $R.
R=${R:-${OUT:-/tmp}/grid_$SHAPE}
source benchmarks/results/h200/session15/lib.sh
setup
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$R/gpu.txt"
timeout ${GRID_TIMEOUT:-570} python3 benchmarks/bench_ffn.py --shapes "$SHAPE" --out "$R/ffn_inference_$SHAPE.json" \
  > "$R/bench_ffn_$SHAPE.log" 2>&1
echo "rc=$?" >> "$R/bench_ffn_$SHAPE.log"
cat "$R/bench_ffn_$SHAPE.log" | grep -v Warning
