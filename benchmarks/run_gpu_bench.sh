#!/bin/bash
# The GPU measurements behind a GPU record (twell_compile/runtime/arch.py) and the inference
# table, in one device call. Outputs under $OUT (each step under its own timeout; rows are written
# as they come, so a cut step keeps its finished points):
#   profile_<M>.log     benchmarks/profile_product.py: the product against the op, per call
#   ffn_inference.json  bench_ffn.py on the grid below, with the paper's kernels beside it
#                       (--reference) where REF names their folder (../shared/anchor/README.md)
#   ffn_decode.json     bench_ffn.py --decode's default grid (the decode cost model's fit)
#   ffn_more.json       a second bench_ffn.py grid where FFN_MORE gives its flags
# Knobs: PROFILE_M ("" skips), FFN_M, FFN_D, FFN_T, FFN_MORE, REF, T_FFN, T_MORE, T_DECODE (0 skips).
OUT=${OUT:-/tmp/gpu_bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/setup.log" 2>&1 || { tail -n 20 "$OUT/setup.log"; exit 1; }
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
for m in ${PROFILE_M-8192 16384}; do
    timeout 120 python3 benchmarks/profile_product.py --M "$m" > "$OUT/profile_$m.log" 2>&1
    sed -n 1,6p "$OUT/profile_$m.log"
done
ref=(); [ -n "${REF:-}" ] && ref=(--reference "$REF")
if [ "${T_FFN:-300}" -gt 0 ]; then
    timeout ${T_FFN:-300} python3 benchmarks/bench_ffn.py --M ${FFN_M:-16384 65536} --density ${FFN_D:-0.005 0.01 0.02 0.05 0.2 1.0} \
        --tail ${FFN_T:-0 0.2} --shapes 2048x5632 "${ref[@]}" --out "$OUT/ffn_inference.json" > "$OUT/ffn.log" 2>&1
    echo "ffn rc=$?" >> "$OUT/ffn.log"
    if [ -n "${FFN_MORE:-}" ]; then
        timeout ${T_MORE:-120} python3 benchmarks/bench_ffn.py $FFN_MORE --shapes 2048x5632 "${ref[@]}" \
            --out "$OUT/ffn_more.json" >> "$OUT/ffn.log" 2>&1
        echo "ffn more rc=$?" >> "$OUT/ffn.log"
    fi
    grep -vE "^\s*$" "$OUT/ffn.log" | grep -vE "Warning|warn" | tail -n 45
fi
if [ "${T_DECODE:-200}" -gt 0 ]; then
    timeout ${T_DECODE:-200} python3 benchmarks/bench_ffn.py --decode --out "$OUT/ffn_decode.json" > "$OUT/decode.log" 2>&1
    echo "decode rc=$?" >> "$OUT/decode.log"
    tail -n 5 "$OUT/decode.log"
fi
