#!/bin/bash
# Session 15 run 4: the new row-kernel and wgrad configs. probe_rows.py at K=4096 (warps rule
# there), the training stage times (old config vs new in one run), the inference target points,
# then the CUDA inference and training tests.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
R="$OUT/run4"; mkdir -p "$R"
(cd benchmarks && timeout 120 python3 results/h200/session15/probe_rows.py 8192 4096 11008 > "$R/probe_rows_4096.log" 2>&1)
grep -E "shipped|best" "$R/probe_rows_4096.log"
timeout 120 python3 benchmarks/bench_ffn_train.py --parts --M 16384 --density 0.005 --tail 0 --reps 50 > "$R/parts.log" 2>&1
grep -E "^ *16384|best" "$R/parts.log"
timeout 150 python3 benchmarks/bench_ffn.py --shapes 2048x5632 --M 16384 65536 --density 0.005 --tail 0 0.2 --reps 50 \
  --out "$R/ffn_inference_2048.json" > "$R/bench_ffn_2048.log" 2>&1
tail -12 "$R/bench_ffn_2048.log"
timeout 200 python3 -m pytest -q -x tests/kernels/test_cuda_train.py tests/kernels/test_cuda_ffn.py > "$R/tests.log" 2>&1
tail -2 "$R/tests.log"
