#!/bin/bash
# Session 16 run 4: bench_dynamic.py, training and inference (compiled FFN across dynamic token
# counts, twell vs inductor, rounds alternating), on the guarded token-count rules; the GPU
# tests that compile inference with changing shapes (generate, decode graphs, modes).
R=${OUT:-/tmp}/run4
. benchmarks/results/h200/session15/lib.sh
setup
for mode in train inference; do
  flag=$([ $mode = inference ] && echo --inference)
  timeout 200 python3 benchmarks/bench_dynamic.py $flag --out $R/dynamic_$mode.json > $R/bench_dynamic_$mode.log 2>&1
  echo "rc=$?" >> $R/bench_dynamic_$mode.log
  grep -vE "Warning|warn|^ +return|^$" $R/bench_dynamic_$mode.log | tail -7
done
timeout 300 python3 -m pytest -q tests/test_generate.py tests/kernels/test_decode_graphs.py tests/test_modes.py \
  > $R/pytest_compile.log 2>&1
echo "rc=$?" >> $R/pytest_compile.log
tail -2 $R/pytest_compile.log
