#!/usr/bin/env bash
# Session 13 run 5: statistics added into counters (all atomic forms) and the rows form's GEMV
# gate at M=1: the decode GPU tests, then a first decode grid (run with the old rule's constants).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run5
timeout 260 python3 -m pytest -q -x tests/kernels/test_decode.py tests/kernels/test_decode_graphs.py \
  --deselect tests/kernels/test_decode.py::test_shipped_decode_rule_reproduces_the_committed_h200_grid \
  > $OUT/run5/tests.log 2>&1
tail -3 $OUT/run5/tests.log
timeout 230 python3 benchmarks/bench_ffn.py --decode --reps 40 --out $OUT/run5/grid1.json > $OUT/run5/grid1.log 2>&1
tail -1 $OUT/run5/grid1.log
