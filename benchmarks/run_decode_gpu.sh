#!/bin/bash
# Issue 7 on the device: decode config sweep, the --decode grid with the tuned configs, the M
# crossover (dense vs decode vs per-row), then GPU tests. Outputs under $OUT (8 files).
OUT=${OUT:-/tmp/decode_out}
mkdir -p "$OUT"
CFG=""
if [ -z "$SKIP_TUNE" ]; then
    timeout ${T_TUNE:-70} python3 benchmarks/tune_decode.py --out "$OUT/decode_configs.json" \
        --policy-out "$OUT/decode_policy.json" > "$OUT/tune.log" 2>&1
    echo "tune rc=$?" >> "$OUT/tune.log"
    [ -s "$OUT/decode_configs.json" ] && CFG="--configs $OUT/decode_configs.json"
    [ -s "$OUT/decode_policy.json" ] && CFG="$CFG --policy $OUT/decode_policy.json"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/bench.log" 2>&1
timeout ${T_BENCH:-70} python3 benchmarks/bench_ffn.py --decode $CFG --reps ${REPS:-40} \
    --out "$OUT/ffn_decode.json" >> "$OUT/bench.log" 2>&1
echo "bench rc=$?" >> "$OUT/bench.log"
timeout ${T_CROSS:-25} python3 benchmarks/bench_ffn.py --decode $CFG --reps ${REPS:-40} \
    --M 64 128 256 512 2048 8192 --density 0.005 0.05 --shapes 2048x5632 \
    --out "$OUT/crossover.json" > "$OUT/crossover.log" 2>&1
echo "crossover rc=$?" >> "$OUT/crossover.log"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" > "$OUT/tests.log" 2>&1
F=tests/kernels/test_cuda_ffn.py
timeout ${T_TEST:-80} python3 -m pytest -q tests/kernels/test_decode.py tests/test_dispatch.py \
    $F::test_exact_grid $F::test_dense_paths_bit_identical_to_eager \
    $F::test_op_policy_starts_dense_then_twell_and_stays_dense_when_dense ${EXTRA_TESTS} \
    >> "$OUT/tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/tests.log"
grep -E "best|fit" "$OUT/tune.log"; tail -n 62 "$OUT/bench.log"; cat "$OUT/crossover.log"; tail -n 25 "$OUT/tests.log"
