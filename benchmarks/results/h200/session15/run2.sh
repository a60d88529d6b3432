#!/bin/bash
# Session 15 run 2: probe_wgrad.py (the DY and X passes apart, 24 launch configs each).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p "$OUT/run2"
cd benchmarks && timeout 400 python3 results/h200/session15/probe_wgrad.py > "$OUT/run2/probe_wgrad.log" 2>&1
echo "rc=$?" >> "$OUT/run2/probe_wgrad.log"; cat "$OUT/run2/probe_wgrad.log" | grep -v Warning
