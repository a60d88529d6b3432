#!/bin/bash
# Session 15 run 10: L2 eviction hints in the inference rows kernel (weights evict_last, x and
# y evict_first), both shapes.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
R="$OUT/run10"; mkdir -p "$R"
cd benchmarks
for shape in "16384 2048 5632" "8192 4096 11008"; do
  PROBE_SET=evict PROBE_ONLY=twell_rows_kernel timeout 150 python3 results/h200/session15/probe_rows.py $shape \
    > "$R/probe_evict_${shape// /_}.log" 2>&1
  grep -E "^M=|twell_rows" "$R/probe_evict_${shape// /_}.log"
done
