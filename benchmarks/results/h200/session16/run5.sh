#!/bin/bash
# Session 16 run 5: bench_dynamic.py (training and inference) on the range-guarded count rules
# (a dynamic decode-sized FFN without CUDA graphs now goes to Inductor); the GPU tests that
# compile with changing shapes or touch the rules (generate, decode graphs, modes, CUDA FFN,
# dispatch, recompiles).
R=${R:-${OUT:-/tmp}/run5}
. benchmarks/results/h200/session15/lib.sh
setup
for mode in inference train; do
  flag=$([ $mode = inference ] && echo --inference)
  timeout 150 python3 benchmarks/bench_dynamic.py $flag --out $R/dynamic_$mode.json > $R/bench_dynamic_$mode.log 2>&1
  echo "rc=$?" >> $R/bench_dynamic_$mode.log
  grep -vE "Warning|warn|^ +return|^$" $R/bench_dynamic_$mode.log | tail -7
done
timeout 330 python3 -m pytest -q tests/test_generate.py tests/kernels/test_decode_graphs.py tests/test_modes.py \
  tests/kernels/test_cuda_ffn.py tests/test_dispatch.py tests/models/test_recompiles.py > $R/pytest_compile.log 2>&1
echo "rc=$?" >> $R/pytest_compile.log
tail -2 $R/pytest_compile.log
