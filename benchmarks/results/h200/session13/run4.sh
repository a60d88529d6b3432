#!/usr/bin/env bash
# (its probe ran at commit 2583eb0 and was removed since: see README.md)
# Session 13 run 4: finer neuron blocks with and without the statistics sum (probe_stats.py).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
S=benchmarks/results/h200/session13
timeout 400 python3 $S/probe_stats.py $OUT/probe_stats.json 2>&1 | grep -v Warning | tee $OUT/probe_stats.log
