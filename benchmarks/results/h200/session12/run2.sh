#!/usr/bin/env bash
# Session 12 run 2: the decode-graph pool fix (GPU tests, and the e2e host probe that hit it),
# and how fast a gate GEMV can read W_gate.
set -x
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
S=benchmarks/results/h200/session12
rm -rf /tmp/torchinductor_root
timeout 240 python3 -m pytest -q -x -k "not interpreter" tests/kernels/test_decode_graphs.py \
  "tests/kernels/test_decode.py::test_recompile_warmup_leaves_nothing_in_the_cudagraph_pool" \
  "tests/kernels/test_decode.py::test_compile_reduce_overhead_decode" 2>&1 | tail -15 | tee $OUT/tests.log
timeout 90 python3 $S/probe_gate.py $OUT/probe_gate.json 2>&1 | grep -v Warning | tee $OUT/probe_gate.log
timeout 200 python3 $S/probe_host_e2e.py $OUT/probe_host_e2e.json 1 2>&1 | grep -v "Warning\|warn" | tail -20 | tee $OUT/probe_host_e2e.log
