#!/bin/bash
# Session 9, device call 3: decode GPU tests (pairs form, per-shape configs; the two tests that
# read the committed grid are left out: that grid is the one made here), then the --decode grid
# with every form forced (grid1), the cost model fitted to it, and the grid again with the
# fitted constants (grid2: the op's path column follows them).
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > $OUT/tests.log 2>&1
timeout ${T_TEST:-330} python3 -m pytest -q -k "not interpreter and not committed" tests/kernels/test_decode.py tests/test_dispatch.py >> $OUT/tests.log 2>&1
echo "pytest rc=$?" >> $OUT/tests.log
tail -n 6 $OUT/tests.log
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > $OUT/grid1.log 2>&1
timeout 150 python3 benchmarks/bench_ffn.py --decode --reps 40 --out $OUT/grid1.json >> $OUT/grid1.log 2>&1
echo "grid1 rc=$?" >> $OUT/grid1.log
python3 benchmarks/tune_decode.py --fit-from $OUT/grid1.json --policy-out $OUT/policy1.json
timeout 150 python3 benchmarks/bench_ffn.py --decode --reps 40 --policy $OUT/policy1.json --out $OUT/ffn_decode.json > $OUT/grid2.log 2>&1
echo "grid2 rc=$?" >> $OUT/grid2.log
tail -n 60 $OUT/grid2.log
