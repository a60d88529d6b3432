#!/bin/bash
# Session 10, device call: broad regression of the op's registration change (compile, modes,
# export, generate, HF models, training op), then the inference grid at the host-bound sizes
# (M = 1, 64, 1024, both shapes, all densities and tails).
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1
timeout 240 python3 -m pytest -q -x tests/test_backend.py tests/test_modes.py tests/test_generate.py tests/test_export.py tests/models tests/kernels/test_cuda_train.py > $OUT/pytest_broad.log 2>&1
echo "pytest rc=$?" >> $OUT/pytest_broad.log
tail -n 5 $OUT/pytest_broad.log
timeout 320 python3 benchmarks/bench_ffn.py --M 1 64 1024 --reps 50 --out $OUT/ffn_inference_small.json > $OUT/bench_ffn_small.log 2>&1
echo "bench rc=$?" >> $OUT/bench_ffn_small.log
cat $OUT/bench_ffn_small.log
