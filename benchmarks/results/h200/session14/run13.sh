#!/usr/bin/env bash
# Session 14 run 13: final code (rule = fit of run 8's grid): the policy-dependent decode GPU
# tests, test_decode_graphs.py, and the compile-level tests.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run13
rm -rf /tmp/torchinductor_root
timeout 330 python3 -m pytest -q tests/kernels/test_decode_graphs.py tests/kernels/test_decode.py \
  -k "op_ or compile or static or deterministic or backend or rule or form or graph or pairs" > $OUT/run13/decode.log 2>&1
tail -2 $OUT/run13/decode.log
rm -rf /tmp/torchinductor_root
timeout 200 python3 -m pytest -q tests/test_dispatch.py tests/test_modes.py tests/test_generate.py > $OUT/run13/compile.log 2>&1
tail -2 $OUT/run13/compile.log
