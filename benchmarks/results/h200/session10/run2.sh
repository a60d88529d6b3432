#!/bin/bash
# Session 10, device call: host time per call (bench_host.py), then the GPU tests of the launch
# path, the op, the decode path, the dispatch and the CUDA inference kernels.
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > $OUT/host.log 2>&1
timeout 120 python3 benchmarks/bench_host.py --out $OUT/host_overhead.json >> $OUT/host.log 2>&1
echo "bench_host rc=$?" >> $OUT/host.log
cat $OUT/host.log
timeout ${T_TEST:-420} python3 -m pytest -q -x -k "not interpreter" tests/kernels/test_launch.py tests/test_ops.py tests/kernels/test_decode.py tests/test_dispatch.py tests/kernels/test_cuda_ffn.py > $OUT/tests.log 2>&1
echo "pytest rc=$?" >> $OUT/tests.log
tail -n 15 $OUT/tests.log
