#!/bin/bash
# Session 15 run 6: rows over W first (compaction's order). CUDA inference + training tests,
# the inference grid at M >= 16384 (both shapes; the forced-kernel column refits the density
# rule), training stage times and the training target points.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
R="$OUT/run6"; mkdir -p "$R"
timeout 200 python3 -m pytest -q -x tests/kernels/test_cuda_train.py tests/kernels/test_cuda_ffn.py > "$R/tests.log" 2>&1
tail -2 "$R/tests.log"
for s in 2048x5632 4096x11008; do
  timeout 150 python3 benchmarks/bench_ffn.py --shapes $s --M 16384 65536 --reps 50 \
    --out "$R/ffn_inference_$s.json" > "$R/bench_ffn_$s.log" 2>&1
  echo "rc=$?" >> "$R/bench_ffn_$s.log"
  grep -E "^ +(16384|65536) .* (0.005|0.01|0.02) |rc=" "$R/bench_ffn_$s.log"
done
timeout 100 python3 benchmarks/bench_ffn_train.py --parts --M 16384 --density 0.005 --tail 0.2 --reps 50 > "$R/parts.log" 2>&1
grep -E "^ *16384|best" "$R/parts.log"
timeout 150 python3 benchmarks/bench_ffn_train.py --M 16384 65536 --density 0.005 0.02 --tail 0 0.2 --reps 50 \
  --out "$R/ffn_training.json" > "$R/grid_train.log" 2>&1
echo "rc=$?" >> "$R/grid_train.log"; cat "$R/grid_train.log" | grep -v Warn | tail -14
