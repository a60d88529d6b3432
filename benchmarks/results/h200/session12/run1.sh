#!/usr/bin/env bash
# Session 12 run 1: decode pairs-form breakdown, and whether the compiled decode step is host-bound.
set -x
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name --format=csv,noheader
S=benchmarks/results/h200/session12
timeout 200 python3 $S/probe_parts.py $OUT/probe_parts.json 2>&1 | grep -v Warning | tee $OUT/probe_parts.log
rm -rf /tmp/torchinductor_root
timeout 360 python3 $S/probe_host_e2e.py $OUT/probe_host_e2e.json 1 8 2>&1 | grep -v "Warning\|warn" | tee $OUT/probe_host_e2e.log
