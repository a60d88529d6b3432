#!/bin/bash
# Session 15 run 11: GPU tests on the final code (training after cuda_policy.poll; the decode
# rule's tests, since cuda_policy changed; generate end to end).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
R="$OUT/run11"; mkdir -p "$R"
timeout 150 python3 -m pytest -q tests/kernels/test_cuda_train.py > "$R/train.log" 2>&1
tail -1 "$R/train.log"
rm -rf /tmp/torchinductor_root
timeout 330 python3 -m pytest -q tests/kernels/test_decode_graphs.py tests/kernels/test_decode.py \
  -k "op_ or compile or static or deterministic or backend or rule or form or graph or pairs" > "$R/decode.log" 2>&1
tail -1 "$R/decode.log"
rm -rf /tmp/torchinductor_root
timeout 100 python3 -m pytest -q tests/test_generate.py tests/kernels/test_cuda_policy.py > "$R/generate.log" 2>&1
tail -1 "$R/generate.log"
