#!/bin/bash
# Session 16 run 2: bench_train_dynamic.py (compiled training step across dynamic token
# counts, twell vs inductor) on the guarded small-M rule; the host cost per op layer; GPU
# tests touching the training rewrite.
R=${OUT:-/tmp}/run2
. benchmarks/results/h200/session15/lib.sh
setup
timeout 200 python3 benchmarks/bench_train_dynamic.py --out $R/train_dynamic.json > $R/bench_train_dynamic.log 2>&1
echo "rc=$?" >> $R/bench_train_dynamic.log
grep -vE "Warning|warn|^ +return|^$" $R/bench_train_dynamic.log | tail -8
timeout 100 python3 benchmarks/results/h200/session16/probe_op_layers.py > $R/probe_op_layers.log 2>&1
echo "rc=$?" >> $R/probe_op_layers.log
grep -E "us/call|rc=" $R/probe_op_layers.log
timeout 240 python3 -m pytest -q tests/test_modes.py tests/models tests/test_dispatch.py tests/passes > $R/pytest_rewrite.log 2>&1
echo "rc=$?" >> $R/pytest_rewrite.log
tail -2 $R/pytest_rewrite.log
