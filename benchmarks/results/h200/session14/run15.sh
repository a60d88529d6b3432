#!/usr/bin/env bash
# Session 14 run 15: final code (rule = fit of run 14's grid, pairs term by row blocks): the
# policy-dependent decode GPU tests and the compile-level tests, as run 13.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run15
rm -rf /tmp/torchinductor_root
timeout 330 python3 -m pytest -q tests/kernels/test_decode_graphs.py tests/kernels/test_decode.py \
  -k "op_ or compile or static or deterministic or backend or rule or form or graph or pairs" > $OUT/run15/decode.log 2>&1
tail -2 $OUT/run15/decode.log
rm -rf /tmp/torchinductor_root
timeout 200 python3 -m pytest -q tests/test_dispatch.py tests/test_modes.py tests/test_generate.py > $OUT/run15/compile.log 2>&1
tail -2 $OUT/run15/compile.log
