#!/usr/bin/env bash
# Session 13 run 6: the decode grid with the refitted rule (constants = fit of run 5's grid),
# bench_e2e at batch 1, and the decode GPU tests run 5 did not reach.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run6
timeout 230 python3 benchmarks/bench_ffn.py --decode --reps 40 --out $OUT/run6/ffn_decode.json > $OUT/run6/grid.log 2>&1
tail -1 $OUT/run6/grid.log
rm -rf /tmp/torchinductor_root
timeout 180 python3 benchmarks/bench_e2e.py --generate --step-loop --batch 1 --seq 128 --new-tokens 128 \
  --density 0.005 --no-energy --out $OUT/run6/e2e_generate_b1.json > $OUT/run6/e2e_b1.log 2>&1
grep "step-loop\|decode tokens\|step loop" $OUT/run6/e2e_b1.log
timeout 130 python3 -m pytest -q -x tests/kernels/test_decode_graphs.py tests/kernels/test_decode.py \
  -k "statistics or nan or odd or configs or graph or compile or shapes" > $OUT/run6/tests.log 2>&1
tail -2 $OUT/run6/tests.log
