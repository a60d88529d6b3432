#!/bin/bash
# Session 15 run 5: the inference rows kernel with PF=2 (next weight rows one step ahead, now
# that a step holds one pair), then the inference grid at M >= 16384 for both shapes.
R="$OUT/run5"; source benchmarks/results/h200/session15/lib.sh; setup
(cd benchmarks && PROBE_ONLY=twell_rows_kernel timeout 100 python3 results/h200/session15/probe_rows.py > "$R/probe_rows_pf2.log" 2>&1)
grep -E "PAIRS': 1|best" "$R/probe_rows_pf2.log"
infer_grid 240 ""
