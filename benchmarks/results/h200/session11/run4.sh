# Session 11 run 4 (H200): the decode grid with the refitted rule (constants = fit of run 3's grid),
# then the compile-level GPU tests that capture CUDA graphs (reduce-overhead, generate) with PDL.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run4
timeout 220 python3 benchmarks/bench_ffn.py --decode --reps 40 --out $OUT/run4/ffn_decode.json > $OUT/run4/grid.log 2>&1
tail -1 $OUT/run4/grid.log
rm -rf /tmp/torchinductor_root
timeout 330 python3 -m pytest -q -x tests/test_modes.py tests/test_generate.py tests/test_dispatch.py > $OUT/run4/tests.log 2>&1
tail -4 $OUT/run4/tests.log
