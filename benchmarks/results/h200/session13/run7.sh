#!/usr/bin/env bash
# Session 13 run 7 (final code after the review mend): all decode GPU tests, then the
# compile-level tests that run decode FFNs (dispatch, modes, generate).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run7
timeout 400 python3 -m pytest -q tests/kernels/test_decode.py tests/kernels/test_decode_graphs.py > $OUT/run7/tests_decode.log 2>&1
tail -2 $OUT/run7/tests_decode.log
rm -rf /tmp/torchinductor_root
timeout 170 python3 -m pytest -q -x tests/test_dispatch.py tests/test_modes.py tests/test_generate.py > $OUT/run7/tests_compile.log 2>&1
tail -2 $OUT/run7/tests_compile.log
