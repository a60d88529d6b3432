#!/usr/bin/env bash
# Session 13 run 2: is the gate loop pipelined on this Triton (inspect_kernels.py); the floor of
# reading 23 MB in a graph (probe_read.py); pipelined pair trips (probe_pipe.py).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
S=benchmarks/results/h200/session13
timeout 120 python3 $S/inspect_kernels.py 2>&1 | grep -v -i warn | tee $OUT/inspect_kernels.log
timeout 200 python3 $S/probe_read.py $OUT/probe_read.json 2>&1 | grep BEST | tee $OUT/probe_read.log
timeout 200 python3 $S/probe_pipe.py $OUT/probe_pipe.json 2>&1 | grep -v Warning | tee $OUT/probe_pipe.log
