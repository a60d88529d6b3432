#!/bin/bash
# Session 16 run 3: the autograd layer's host cost per training step (custom_op vs Library +
# autograd.Function) at 1024 and 4096 tokens; the rewrite tests run 2 cut off (timeout).
R=${OUT:-/tmp}/run3
. benchmarks/results/h200/session15/lib.sh
setup
for m in 1024 4096; do
  timeout 100 python3 benchmarks/results/h200/session16/probe_autograd.py $m > $R/probe_autograd_$m.log 2>&1
  echo "rc=$?" >> $R/probe_autograd_$m.log
  grep -E "M=|rel diff|rc=|Error" $R/probe_autograd_$m.log
done
timeout 330 python3 -m pytest -q tests/test_modes.py tests/models/test_recompiles.py tests/test_dispatch.py > $R/pytest_rewrite.log 2>&1
echo "rc=$?" >> $R/pytest_rewrite.log
tail -2 $R/pytest_rewrite.log
