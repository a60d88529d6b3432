# Session 18's shared step (sourced after session15/lib.sh; R names the output folder).
# grid NAME TIMEOUT ARGS...: bench_ffn.py with ARGS into $R/NAME.json and .log; prints its rows
grid() {
  local name=$1 t=$2; shift 2
  PYTHONUNBUFFERED=1 timeout "$t" python3 benchmarks/bench_ffn.py --reps 50 --out "$R/$name.json" "$@" > "$R/$name.log" 2>&1
  echo "rc=$?" >> "$R/$name.log"; grep -v Warn "$R/$name.log" | grep -E "^ +[0-9]|rc=|Error"
}
