#!/bin/bash
# Session 15 run 13: probe_dense.py (the op's dense path vs eager at prefill sizes).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p "$OUT/run13"
cd benchmarks && timeout 300 python3 results/h200/session15/probe_dense.py > "$OUT/run13/probe_dense.log" 2>&1
echo "rc=$?" >> "$OUT/run13/probe_dense.log"; grep -v Warn "$OUT/run13/probe_dense.log"
