#!/bin/bash
# Session 15 run 6: rows over W first (compaction's order). CUDA inference + training tests,
# the inference grid at M >= 16384 (both shapes; the forced-kernel column refits the density
# rule), training stage times and the training target points.
R="$OUT/run6"; source benchmarks/results/h200/session15/lib.sh; setup
timeout 200 python3 -m pytest -q -x tests/kernels/test_cuda_train.py tests/kernels/test_cuda_ffn.py > "$R/tests.log" 2>&1
tail -2 "$R/tests.log"
infer_grid 150 " .* (0.005|0.01|0.02) "
timeout 100 python3 benchmarks/bench_ffn_train.py --parts --M 16384 --density 0.005 --tail 0.2 --reps 50 > "$R/parts.log" 2>&1
grep -E "^ *16384|best" "$R/parts.log"
timeout 150 python3 benchmarks/bench_ffn_train.py --M 16384 65536 --density 0.005 0.02 --tail 0 0.2 --reps 50 \
  --out "$R/ffn_training.json" > "$R/grid_train.log" 2>&1
echo "rc=$?" >> "$R/grid_train.log"; cat "$R/grid_train.log" | grep -v Warn | tail -14
