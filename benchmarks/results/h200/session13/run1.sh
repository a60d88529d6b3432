#!/usr/bin/env bash
# Session 13 run 1: W_gate prefetch into L2 before the PDL wait (probe_prefetch.py), then
# session 12's prepared sweep of the pairs form's up projection.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
S=benchmarks/results/h200
timeout 240 python3 $S/session13/probe_prefetch.py $OUT/probe_prefetch.json 2>&1 | grep -v Warning | tee $OUT/probe_prefetch.log
timeout 330 python3 $S/session12/sweep_pairs_up.py $OUT/sweep_pairs_up.json 2>&1 | grep -v Warning | grep BEST | tee $OUT/sweep_pairs_up.log
