# Session 11 run 14 (H200): final GPU tests with the op's own graphs: decode_graphs, dispatch, ops,
# the decode op subset, and the compile-level tests that capture CUDA graphs (reduce-overhead).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run14
timeout 120 python3 -m pytest -q tests/kernels/test_decode_graphs.py tests/test_dispatch.py tests/test_ops.py > $OUT/run14/tests.log 2>&1
tail -1 $OUT/run14/tests.log
rm -rf /tmp/torchinductor_root
timeout 420 python3 -m pytest -q tests/test_modes.py tests/test_generate.py tests/test_backend.py tests/test_export.py tests/models > $OUT/run14/tests_compile.log 2>&1
tail -3 $OUT/run14/tests_compile.log
