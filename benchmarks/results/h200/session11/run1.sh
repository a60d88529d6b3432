# Session 11 run 1 (H200): programmatic dependent launch for the decode kernels, A/B by TWELL_PDL,
# then the decode and launch GPU tests.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
python3 -c "import triton, triton.language.extra.cuda as c; print('triton', triton.__version__, 'gdc_wait', hasattr(c, 'gdc_wait'))"
mkdir -p $OUT/run1
for pdl in 0 1 0 1; do
  TWELL_PDL=$pdl timeout 120 python3 benchmarks/bench_ffn.py --decode --M 1 4 16 --density 0.005 \
    --shapes 2048x5632 4096x11008 --reps 40 --out $OUT/run1/decode_pdl$pdl.json > $OUT/run1/decode_pdl$pdl.$RANDOM.log 2>&1
done
grep -h "^ *[0-9]\|M=" $OUT/run1/decode_pdl*.log | head -60
timeout 280 python3 -m pytest -q -x -k "not interpreter" tests/kernels/test_decode.py tests/kernels/test_launch.py > $OUT/run1/tests.log 2>&1
tail -5 $OUT/run1/tests.log
