#!/bin/bash
# Session 9, device call 4: the final decode code's GPU tests (committed-grid and deterministic
# tests included), then end-to-end decode (bench_e2e --generate --step-loop) at batch 1, 8, 16.
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > $OUT/tests.log 2>&1
timeout 300 python3 -m pytest -q -k "not interpreter" tests/kernels/test_decode.py tests/test_dispatch.py >> $OUT/tests.log 2>&1
echo "pytest rc=$?" >> $OUT/tests.log
tail -n 4 $OUT/tests.log
for B in 1 8 16; do
    timeout 150 python3 benchmarks/bench_e2e.py --generate --step-loop --batch $B --seq 128 --new-tokens 128 \
        --density 0.005 --no-energy --out $OUT/e2e_generate_b$B.json > $OUT/e2e_b$B.log 2>&1
    echo "e2e b$B rc=$?" >> $OUT/e2e_b$B.log
    grep -E "step loop|decode |x decode|x step|rc=" $OUT/e2e_b$B.log
done
