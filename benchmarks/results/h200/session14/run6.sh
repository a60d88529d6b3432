#!/usr/bin/env bash
# Session 14 run 6: the decode grid under the refitted rule (relative least squares, the pairs
# form's trips: run 5's grid), then every decode GPU test.
. benchmarks/results/h200/session14/lib.sh
RUN=run6
setup
grid ffn_decode grid
rm -rf /tmp/torchinductor_root
timeout 380 python3 -m pytest -q tests/kernels/test_decode_graphs.py tests/kernels/test_decode.py > $OUT/run6/tests.log 2>&1
tail -3 $OUT/run6/tests.log
