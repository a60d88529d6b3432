#!/bin/bash
# Session 18 run 4: issue 3's grid with the product (twell_ms) against the same module compiled
# by Inductor: K=2048 all M (default mode), M=1 and 64 under reduce-overhead, K=4096 prefill.
R=${R:-${OUT:-/tmp}/run4}
source benchmarks/results/h200/session15/lib.sh
setup
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$R/gpu.txt"; cat "$R/gpu.txt"
source benchmarks/results/h200/session18/lib.sh
grid ffn_2048 200 --shapes 2048x5632
grid ffn_2048_decode_ro 120 --shapes 2048x5632 --M 1 64 --mode reduce-overhead
grid ffn_4096 200 --shapes 4096x11008 --M 16384 65536
