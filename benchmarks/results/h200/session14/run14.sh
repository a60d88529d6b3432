#!/usr/bin/env bash
# Session 14 run 14: the list form back at its own config (lbn 32, pb 4, 4 warps; the pairs form
# keeps 16 / 2 / 2 through Config.pbn/ppb/pwarps): the grid under the rule of run 8's fit, its refit.
. benchmarks/results/h200/session14/lib.sh
RUN=run14
setup
grid ffn_decode grid
fit ffn_decode fit
timeout 200 python3 -m pytest -q tests/kernels/test_decode.py -k "list or pairs or deterministic or form" > $OUT/run14/tests.log 2>&1
tail -2 $OUT/run14/tests.log
