# Steps shared by session 14's device scripts (sourced by runN.sh from the repo root; RUN names
# the output folder $OUT/$RUN).
setup() {
  python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
  mkdir -p "$OUT/$RUN"
}

# grid JSON LOG [TIMEOUT]: the decode grid under the shipped rule, its summary line and the
# K=2048 d=0.005 rows up to M=16
grid() {
  timeout "${3:-200}" python3 benchmarks/bench_ffn.py --decode --reps 40 --out "$OUT/$RUN/$1.json" > "$OUT/$RUN/$2.log" 2>&1
  tail -1 "$OUT/$RUN/$2.log"
  grep -E "^ *(1|2|4|8|16) +2048 .*0.005" "$OUT/$RUN/$2.log"
}

# fit JSON FIT: the decode rule's constants fitted to a grid
fit() {
  python3 benchmarks/tune_decode.py --fit-from "$OUT/$RUN/$1.json" --policy-out "$OUT/$RUN/$2.json"
}

# final_tests: the policy-dependent decode GPU tests and the compile-level tests
final_tests() {
  rm -rf /tmp/torchinductor_root
  timeout 330 python3 -m pytest -q tests/kernels/test_decode_graphs.py tests/kernels/test_decode.py \
    -k "op_ or compile or static or deterministic or backend or rule or form or graph or pairs" > "$OUT/$RUN/decode.log" 2>&1
  tail -2 "$OUT/$RUN/decode.log"
  rm -rf /tmp/torchinductor_root
  timeout 200 python3 -m pytest -q tests/test_dispatch.py tests/test_modes.py tests/test_generate.py > "$OUT/$RUN/compile.log" 2>&1
  tail -2 "$OUT/$RUN/compile.log"
}
