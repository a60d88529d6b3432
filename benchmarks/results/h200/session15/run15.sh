#!/bin/bash
# Session 15 run 15: bench_e2e --train (twell.l1=12, twell only) with session 14's launch
# configs, then the shipped ones, then session 14's again (e2e_train_config.py).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
R="$OUT/${RUN:-run15}"; mkdir -p "$R"
cd benchmarks
for c in ${CONFIGS:-old new old}; do
  CONFIG=$c timeout 170 python3 results/h200/session15/e2e_train_config.py --train --density 0.005 --backends twell \
    --no-energy --twell-opt twell.l1=12 --out "$R/e2e_train_$c.json" > "$R/e2e_train_$c.log" 2>&1
  echo "rc=$?" >> "$R/e2e_train_$c.log"
  grep -E "^config|twell: step|rc=" "$R/e2e_train_$c.log"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print([round(x) for x in d['runs'][0]['backends']['twell']['step_ms']])" "$R/e2e_train_$c.json"
  mv "$R/e2e_train_$c.json" "$R/e2e_train_${c}_$RANDOM.json"
done
