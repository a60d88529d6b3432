#!/bin/bash
# The GPU tests and one product point, in one device call. Outputs under $OUT:
#   tests.log         pytest -v -m gpu: weight updates, density, decode graphs, launch, generate,
#                     modes, the inference and training launchers (T_TESTS seconds)
#   decode_tests.log  pytest -v -m gpu on the decode path without its long grids (T_DECODE_TESTS)
#   ffn.json, ffn.log bench_ffn.py at M=16384, d=0.005, K=2048, N=5632 (T_FFN; skipped at 0)
# Each log is written as the tests run, so a run cut by its timeout still says how far it got.
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# the device's own torch/triton stay; the package goes in editable (twell_compile.passes is
# mapped from passes/ by the install)
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/setup.log" 2>&1 || { tail -n 20 "$OUT/setup.log"; exit 1; }
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > "$OUT/tests.log" 2>&1
head -n 1 "$OUT/tests.log"
timeout ${T_TESTS:-330} python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --durations=10 \
    tests/test_weight_updates.py tests/runtime/test_density.py tests/runtime/test_decode_graphs.py \
    tests/runtime/test_launch.py tests/test_generate.py tests/test_modes.py \
    tests/runtime/test_cuda_infer.py tests/runtime/test_cuda_train.py >> "$OUT/tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/tests.log"
grep -cE " PASSED" "$OUT/tests.log" | sed 's/^/passed: /'
grep -E " FAILED| ERROR|^FAILED|^ERROR|rc=|passed|failed" "$OUT/tests.log" | tail -n 25
timeout ${T_DECODE_TESTS:-100} python3 -m pytest -v -m gpu -p no:cacheprovider -rfE \
    tests/runtime/test_cuda_decode.py -k "not grid and not configs" > "$OUT/decode_tests.log" 2>&1
echo "pytest decode rc=$?" >> "$OUT/decode_tests.log"
grep -E " FAILED| ERROR|rc=|passed|failed" "$OUT/decode_tests.log" | tail -n 12
if [ "${T_FFN:-60}" -gt 0 ]; then
    timeout ${T_FFN:-60} python3 benchmarks/bench_ffn.py --M 16384 --density 0.005 --shapes 2048x5632 \
        --out "$OUT/ffn.json" > "$OUT/ffn.log" 2>&1
    echo "ffn rc=$?" >> "$OUT/ffn.log"
    tail -n 8 "$OUT/ffn.log"
fi
