#!/bin/bash
# Issue 7 on the device: decode GPU tests first (a wrong kernel is not worth timing), then the
# config sweep with its parts breakdown, the --decode grid with the tuned configs, and (unless
# SKIP_CROSS is set) the M crossover (dense vs decode vs per-row). Outputs under $OUT; the
# canonical grid is refreshed only by copying $OUT/ffn_decode.json (benchmarks/results/README.md).
OUT=${OUT:-/tmp/decode_out}
mkdir -p "$OUT"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > "$OUT/tests.log" 2>&1
F=tests/runtime/test_cuda_infer.py
timeout ${T_TEST:-120} python3 -m pytest -q -x tests/runtime/test_cuda_decode.py tests/runtime/test_select.py \
    $F::test_exact_grid $F::test_dense_paths_bit_identical_to_eager \
    $F::test_op_plan_starts_dense_then_twell_and_stays_dense_when_dense ${EXTRA_TESTS} \
    >> "$OUT/tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/tests.log"
tail -n 15 "$OUT/tests.log"
CFG=""
if [ -z "$SKIP_TUNE" ]; then
    timeout ${T_TUNE:-150} python3 benchmarks/tune_decode.py --buckets ${BUCKETS:-16 32 64} \
        --out "$OUT/decode_configs.json" --policy-out "$OUT/decode_policy.json" > "$OUT/tune.log" 2>&1
    echo "tune rc=$?" >> "$OUT/tune.log"
    [ -s "$OUT/decode_configs.json" ] && CFG="--configs $OUT/decode_configs.json"
    [ -s "$OUT/decode_policy.json" ] && CFG="$CFG --policy $OUT/decode_policy.json"
    grep -E "best|fit|parts|rc=" "$OUT/tune.log"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/bench.log" 2>&1
timeout ${T_BENCH:-90} python3 benchmarks/bench_ffn.py --decode $CFG --reps ${REPS:-40} \
    --out "$OUT/ffn_decode.json" >> "$OUT/bench.log" 2>&1
echo "bench rc=$?" >> "$OUT/bench.log"
tail -n 62 "$OUT/bench.log"
if [ -z "$SKIP_CROSS" ]; then
    timeout ${T_CROSS:-25} python3 benchmarks/bench_ffn.py --decode $CFG --reps ${REPS:-40} \
        --M 64 128 256 512 2048 8192 --density 0.005 0.05 --shapes 2048x5632 \
        --out "$OUT/crossover.json" > "$OUT/crossover.log" 2>&1
    echo "crossover rc=$?" >> "$OUT/crossover.log"
    cat "$OUT/crossover.log"
fi
