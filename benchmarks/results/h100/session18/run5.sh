#!/bin/bash
# Session 18 run 5: after the bench_ffn fix (the op, the kernels and the product read the
# product's weights and its W_down^T copy, refreshed in place per point; run 4 registered a new
# copy per point and freed the old one, which CUDA graphs captured under reduce-overhead still
# read: errors of 1.4-9 at M=1 and 64): the reduce-overhead decode points, then K=2048 prefill.
R=${R:-${OUT:-/tmp}/run5}
source benchmarks/results/h200/session15/lib.sh
setup
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$R/gpu.txt"; cat "$R/gpu.txt"
grid() {   # NAME TIMEOUT ARGS...
  local name=$1 t=$2; shift 2
  PYTHONUNBUFFERED=1 timeout "$t" python3 benchmarks/bench_ffn.py --reps 50 --out "$R/$name.json" "$@" > "$R/$name.log" 2>&1
  echo "rc=$?" >> "$R/$name.log"; grep -v Warn "$R/$name.log" | grep -E "^ +[0-9]|rc=|Error"
}
grid ffn_2048_decode_ro 150 --shapes 2048x5632 --M 1 64 --mode reduce-overhead
grid ffn_2048_prefill 150 --shapes 2048x5632 --M 16384 65536
