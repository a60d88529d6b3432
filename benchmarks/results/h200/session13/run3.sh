#!/usr/bin/env bash
# (its probe ran at commit 2583eb0 and was removed since: see README.md)
# Session 13 run 3: the rows form with a whole-row GEMV gate over finer neuron blocks (probe_gemv.py).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
S=benchmarks/results/h200/session13
timeout 400 python3 $S/probe_gemv.py $OUT/probe_gemv.json 2>&1 | grep -v Warning | tee $OUT/probe_gemv.log
timeout 120 python3 $S/inspect_kernels.py 2>&1 | grep -v -i warn | tee $OUT/inspect_kernels.log
