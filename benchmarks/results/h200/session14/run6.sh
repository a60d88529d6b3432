#!/usr/bin/env bash
# Session 14 run 6: the decode grid under the refitted rule (relative least squares, the pairs
# form's trips: run 5's grid), then every decode GPU test.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run6
timeout 200 python3 benchmarks/bench_ffn.py --decode --reps 40 --out $OUT/run6/ffn_decode.json > $OUT/run6/grid.log 2>&1
tail -1 $OUT/run6/grid.log
grep -E "^ *(1|2|4|8|16) +2048 .*0.005" $OUT/run6/grid.log
rm -rf /tmp/torchinductor_root
timeout 380 python3 -m pytest -q tests/kernels/test_decode_graphs.py tests/kernels/test_decode.py > $OUT/run6/tests.log 2>&1
tail -3 $OUT/run6/tests.log
