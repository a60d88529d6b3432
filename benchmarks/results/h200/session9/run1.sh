#!/bin/bash
# Session 9, device call 1: decode GPU tests (with the new pairs form), then the list/pairs sweep.
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > $OUT/tests.log 2>&1
timeout 200 python3 -m pytest -q -x -k "not interpreter" tests/kernels/test_decode.py tests/test_dispatch.py >> $OUT/tests.log 2>&1
echo "pytest rc=$?" >> $OUT/tests.log
tail -n 8 $OUT/tests.log
timeout 330 python3 benchmarks/results/h200/session9/sweep_pairs.py $OUT/sweep.json > $OUT/sweep.log 2>&1
echo "sweep rc=$?" >> $OUT/sweep.log
grep -E "BEST|rc=|Error|error" $OUT/sweep.log | head -40
