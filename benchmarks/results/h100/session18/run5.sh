#!/bin/bash
# Session 18 run 5: after the bench_ffn fix (the op, the kernels and the product read the
# product's weights and its W_down^T copy, refreshed in place per point; run 4 registered a new
# copy per point and freed the old one, which CUDA graphs captured under reduce-overhead still
# read: errors of 1.4-9 at M=1 and 64): the reduce-overhead decode points, then K=2048 prefill.
R=${R:-${OUT:-/tmp}/run5}
source benchmarks/results/h200/session15/lib.sh
setup
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$R/gpu.txt"; cat "$R/gpu.txt"
source benchmarks/results/h200/session18/lib.sh
grid ffn_2048_decode_ro 150 --shapes 2048x5632 --M 1 64 --mode reduce-overhead
grid ffn_2048_prefill 150 --shapes 2048x5632 --M 16384 65536
