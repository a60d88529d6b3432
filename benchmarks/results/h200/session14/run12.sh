#!/usr/bin/env bash
# Session 14 run 12: CUDA-graph re-records per generate() call (probe_rerecord.py), batch 16 and 1.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run12
rm -rf /tmp/torchinductor_root
timeout 400 python3 benchmarks/results/h200/session14/probe_rerecord.py $OUT/run12/probe.json 16 1 > $OUT/run12/probe.log 2>&1
grep -v "^{" $OUT/run12/probe.log | tail -8 | cut -c1-900
