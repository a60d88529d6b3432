#!/usr/bin/env bash
# Session 14 run 5: the decode grid with the new pairs config (lbn 16, pb 2, 2 warps) under the
# old rule; the rule refitted to it (tune_decode.py --fit-from, apply_fit.py); the grid again.
. benchmarks/results/h200/session14/lib.sh
RUN=run5
setup
grid grid1 grid1 250
fit grid1 fit1
python3 benchmarks/results/h200/session14/apply_fit.py $OUT/run5/fit1.json
grid grid2 grid2 250
