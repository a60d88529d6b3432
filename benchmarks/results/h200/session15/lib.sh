# Steps shared by session 15's device scripts (sourced from the repo root; R names the output
# folder).
setup() {
  python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
  mkdir -p "$R"
}

# infer_grid TIMEOUT PATTERN: bench_ffn.py at M = 16384 and 65536 for both shapes, one JSON and
# log per shape in $R; prints the rows matching PATTERN (after "^ +(16384|65536)") and rc
infer_grid() {
  for s in 2048x5632 4096x11008; do
    timeout "$1" python3 benchmarks/bench_ffn.py --shapes $s --M 16384 65536 --reps 50 \
      --out "$R/ffn_inference_$s.json" > "$R/bench_ffn_$s.log" 2>&1
    echo "rc=$?" >> "$R/bench_ffn_$s.log"
    grep -E "^ +(16384|65536)$2|rc=" "$R/bench_ffn_$s.log"
  done
}
