#!/usr/bin/env bash
# Session 14 run 11: probe_generate.py at batch 1 and 16 with recording/recompile counts.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run11
rm -rf /tmp/torchinductor_root
timeout 450 python3 benchmarks/results/h200/session14/probe_generate.py $OUT/run11/probe.json 1 16 > $OUT/run11/probe.log 2>&1
tail -2 $OUT/run11/probe.log | cut -c1-300
python3 - <<'PY'
import json, os
for r in json.load(open(os.environ["OUT"] + "/run11/probe.json")):
    print(r["backend"], "b", r["batch"], "wall", round(r["generate_wall_ms"], 1), "prof", round(r["profiled_wall_ms"], 1),
          "busy ms/step", round(r["device_busy_ms_per_step"], 3), "k/step", round(r["kernels_per_step"], 1),
          r["events"], r["recompiles"], r["stats"], r["op_graphs_before"], r["op_graphs_after"])
    print("  cpu", r["top_cpu"][:10])
PY
