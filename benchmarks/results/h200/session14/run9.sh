#!/usr/bin/env bash
# Session 14 run 9: where generate() spends a decode step (probe_generate.py), per backend.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run9
rm -rf /tmp/torchinductor_root
timeout 400 python3 benchmarks/results/h200/session14/probe_generate.py $OUT/run9/probe.json > $OUT/run9/probe.log 2>&1
tail -3 $OUT/run9/probe.log | cut -c1-600
python3 - <<'PY'
import json, os
for r in json.load(open(os.environ["OUT"] + "/run9/probe.json")):
    print(r["backend"], "kernels/step", round(r["kernels_per_step"], 1), "busy ms/step", round(r["device_busy_ms_per_step"], 3), r["syncs"])
    print("  cpu", r["top_cpu"][:12])
PY
