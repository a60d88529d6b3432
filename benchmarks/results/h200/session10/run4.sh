#!/bin/bash
# Session 10, device call after the review mend: host time per call with the standard-launch
# variant's environment switch around its timing loop (run 2 set it per call), the profiler
# view of one op call, the launch/ops/decode-interface tests, and the training op's GPU tests
# (relu_mul_rows now launches through kernels/launch.py).
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > $OUT/host.log 2>&1
timeout 120 python3 benchmarks/bench_host.py --out $OUT/host_overhead.json >> $OUT/host.log 2>&1
echo "bench_host rc=$?" >> $OUT/host.log
cat $OUT/host.log
PYTHONPATH=. timeout 90 python3 benchmarks/results/h200/session10/probe_trace.py > $OUT/probe_trace.log 2>&1
echo "probe_trace rc=$?" >> $OUT/probe_trace.log
timeout 330 python3 -m pytest -q -x -k "not interpreter" tests/kernels/test_launch.py tests/test_ops.py tests/kernels/test_cuda_train.py tests/kernels/test_cuda_train_host.py tests/kernels/test_decode.py > $OUT/tests.log 2>&1
echo "pytest rc=$?" >> $OUT/tests.log
tail -n 6 $OUT/tests.log
