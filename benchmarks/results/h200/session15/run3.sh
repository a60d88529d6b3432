#!/bin/bash
# Session 15 run 3: probe_rows.py (per-row kernels and the wgrad passes at 1-2 warps).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p "$OUT/run3"
cd benchmarks && timeout 400 python3 results/h200/session15/probe_rows.py > "$OUT/run3/probe_rows.log" 2>&1
echo "rc=$?" >> "$OUT/run3/probe_rows.log"; grep -v Warning "$OUT/run3/probe_rows.log"
