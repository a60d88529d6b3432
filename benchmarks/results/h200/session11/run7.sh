# Session 11 run 7 (run 6 hit a stale shared pool after clear()) (H200): the op's own CUDA graphs for eager decode calls (decode_graphs.py):
# GPU tests, host time per call, and the issue-3 grid rows at M = 1 and 64 (eager op calls).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run7
timeout 200 python3 -m pytest -q tests/kernels/test_decode_graphs.py tests/test_ops.py tests/test_dispatch.py tests/kernels/test_launch.py > $OUT/run7/tests.log 2>&1
tail -2 $OUT/run7/tests.log
timeout 150 python3 -m pytest -q -x tests/kernels/test_decode.py -k "not interpreter and (op or capture or graph or nan)" > $OUT/run7/tests_decode.log 2>&1
tail -1 $OUT/run7/tests_decode.log
timeout 150 python3 benchmarks/bench_host.py --M 1 16 64 --out $OUT/run7/host_overhead.json --rounds 4 2>&1 | tee $OUT/run7/host.log | grep -v Warn
timeout 200 python3 benchmarks/bench_ffn.py --M 1 64 --shapes 2048x5632 --reps 50 --out $OUT/run7/ffn_small.json > $OUT/run7/grid_small.log 2>&1
tail -30 $OUT/run7/grid_small.log
