#!/bin/bash
# The whole GPU test suite (pytest -m gpu) and the performance check, in one device call.
# Outputs under $OUT (8 files: the device tool brings back at most 8; set-up logs, test ids and
# shards stay in a scratch folder):
#   tests_<shard>.log  pytest on one shard of the GPU tests' ids (SHARDS processes side by side,
#                      the ids dealt round-robin so each holds its share of the slow decode grids;
#                      no timing test is among them). A shard without a summary line hit T_TESTS.
#   check_perf.json,   benchmarks/check_perf.py --suites $PERF_SUITES after the tests, alone on the
#   check_perf.log     GPU (T_PERF seconds; 0 skips it)
# The fused gate (csrc/, CUTLASS) is built first where a carried nvidia-cutlass wheel lies in .whl/
# (pip's --target /tmp/site), so no shard waits on the build. On an H100: the build 77 s, the
# whole suite (1231 tests) in 8 shards 200 s; check_perf's three suites about 60 s more.
# Knobs: SHARDS (8), T_TESTS (420), PERF_SUITES ("inference nongated decode training"), T_PERF (200).
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1
if ls .whl/nvidia_cutlass-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/nvidia_cutlass-*.whl > "$WORK/setup.log" 2>&1 || { tail -n 20 "$WORK/setup.log"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} MAX_JOBS=${MAX_JOBS:-16}
fi
# the device's own torch/triton stay; the package goes in editable (twell_compile.passes is
# mapped from passes/ by the install)
python3 -m pip install -q --no-deps --no-build-isolation -e . >> "$WORK/setup.log" 2>&1 || { tail -n 20 "$WORK/setup.log"; exit 1; }
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
git log --oneline -1 2>/dev/null
t0=$(date +%s)
python3 -c "from twell_compile.runtime import cuda_gate; cuda_gate.module()" > "$WORK/build.log" 2>&1
rc=$?
echo "fused gate build rc=$rc in $(( $(date +%s) - t0 )) s (a failure skips its tests)"
[ $rc -eq 0 ] || tail -n 30 "$WORK/build.log"
P="python3 -m pytest -q -m gpu -p no:cacheprovider -rfE"
ids="$WORK/gpu_test_ids.txt"
$P --collect-only tests 2>/dev/null | grep "::" > "$ids"
echo "GPU tests: $(wc -l < "$ids")"
split -n "r/${SHARDS:-8}" "$ids" "$WORK/shard_"
t0=$(date +%s)
for s in "$WORK"/shard_*; do
    (xargs -d '\n' -a "$s" timeout "${T_TESTS:-420}" $P > "$OUT/tests_$(basename "$s").log" 2>&1) &
done
wait
echo "tests in $(( $(date +%s) - t0 )) s"
for f in "$OUT"/tests_shard_*.log; do
    line=$(grep -E "passed|failed|error" "$f" | tail -n 1)
    echo "$(basename "$f"): ${line:-no summary line (cut by T_TESTS)}"
    grep -E "^(FAILED|ERROR)" "$f" | cut -c1-250
    # a failure's assertion and the seeds of its fresh inputs (tests/helpers.ffn_with_biases), in
    # this call's output: the shard's log may be one of the files left behind
    grep -q -E "^(FAILED|ERROR)" "$f" && grep -E "^E |^ffn_with_biases\(" "$f" | head -n 20 | cut -c1-250
done
if [ "${T_PERF:-200}" -gt 0 ]; then
    timeout "${T_PERF:-200}" python3 benchmarks/check_perf.py --suites ${PERF_SUITES:-inference nongated decode training} \
        --out "$OUT/check_perf.json" > "$OUT/check_perf.log" 2>&1
    echo "check_perf rc=$?"
    grep -E "^(inference|nongated|decode|training|cpu) |check_perf on" "$OUT/check_perf.log" | cut -c1-250
fi
