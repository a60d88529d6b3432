#!/bin/bash
# Session 9, device call 2: decode GPU tests (pairs form, per-shape configs), then the --decode
# grid with every form forced (the cost model's fit comes from it).
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > $OUT/tests.log 2>&1
timeout ${T_TEST:-330} python3 -m pytest -q -x -k "not interpreter" tests/kernels/test_decode.py tests/test_dispatch.py >> $OUT/tests.log 2>&1
echo "pytest rc=$?" >> $OUT/tests.log
tail -n 6 $OUT/tests.log
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > $OUT/bench.log 2>&1
timeout ${T_BENCH:-200} python3 benchmarks/bench_ffn.py --decode --reps 40 --out $OUT/ffn_decode.json >> $OUT/bench.log 2>&1
echo "bench rc=$?" >> $OUT/bench.log
tail -n 62 $OUT/bench.log
