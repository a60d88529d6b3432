#!/bin/bash
# GPU tests, then the decode grid and the per-row points, in one device call. Outputs under $OUT:
#   tests.log            pytest -m gpu (every GPU test but the long decode sweep, then that sweep)
#   ffn_decode.json      bench_ffn.py --decode, K=2048 N=5632, M 1..64, d .005/.02
#   ffn_inference.json   bench_ffn.py, K=2048 N=5632, M 8192/16384, d .005
# Times: T_TESTS, T_DECODE_TESTS, T_DECODE, T_FFN (seconds each).
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# the device's own torch/triton stay; the package goes in editable (twell_compile.passes is
# mapped from passes/ by the install)
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/setup.log" 2>&1 || { tail -n 20 "$OUT/setup.log"; exit 1; }
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > "$OUT/tests.log" 2>&1
timeout ${T_TESTS:-240} python3 -m pytest -q -m gpu -p no:cacheprovider --ignore=tests/runtime/test_cuda_decode.py \
    ${TESTS:-tests} >> "$OUT/tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/tests.log"
timeout ${T_DECODE_TESTS:-120} python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/runtime/test_cuda_decode.py \
    >> "$OUT/tests.log" 2>&1
echo "pytest decode rc=$?" >> "$OUT/tests.log"
grep -E "passed|failed|rc=|Error" "$OUT/tests.log" | tail -n 30
timeout ${T_DECODE:-90} python3 benchmarks/bench_ffn.py --decode --reps ${REPS:-40} --M 1 2 4 8 16 32 64 \
    --density 0.005 0.02 --shapes 2048x5632 --out "$OUT/ffn_decode.json" > "$OUT/decode.log" 2>&1
echo "decode rc=$?" >> "$OUT/decode.log"
tail -n 20 "$OUT/decode.log"
timeout ${T_FFN:-120} python3 benchmarks/bench_ffn.py --M 8192 16384 --density 0.005 --shapes 2048x5632 \
    --out "$OUT/ffn_inference.json" > "$OUT/ffn.log" 2>&1
echo "ffn rc=$?" >> "$OUT/ffn.log"
tail -n 12 "$OUT/ffn.log"
