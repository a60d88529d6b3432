# Session 11 run 5 (H200): generate() and the compiled step loop at batch 1 and 8 with the shipped
# rule, then the remaining compile-level GPU tests.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run5
for b in 1 8; do
  timeout 200 python3 benchmarks/bench_e2e.py --generate --step-loop --batch $b --seq 128 --new-tokens 128 \
    --density 0.005 --no-energy --out $OUT/run5/e2e_generate_b$b.json > $OUT/run5/e2e_b$b.log 2>&1
  grep "step-loop\|decode tokens\|step loop" $OUT/run5/e2e_b$b.log
done
rm -rf /tmp/torchinductor_root
timeout 250 python3 -m pytest -q -x tests/test_backend.py tests/test_export.py tests/models > $OUT/run5/tests.log 2>&1
tail -2 $OUT/run5/tests.log
