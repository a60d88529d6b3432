# Session 11 run 2 (H200): pairs-form config sweep with PDL on (M=16, 8), then the compiled
# decode step's steady state (session 9's probe) with PDL on and off, batch 1.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run2
timeout 200 python3 benchmarks/results/h200/session11/sweep_pdl.py $OUT/run2/sweep_pdl.json > $OUT/run2/sweep_pdl.log 2>&1
grep BEST $OUT/run2/sweep_pdl.log
for pdl in 1 0; do
  TWELL_PDL=$pdl timeout 170 python3 benchmarks/results/h200/session9/probe_e2e.py $OUT/run2/probe_e2e_pdl$pdl.json 1 > $OUT/run2/probe_e2e_pdl$pdl.log 2>&1
  grep -o '"backend": "[a-z]*"\|"wall_ms_per_step": [0-9.]*\|"kernel_ms_per_step": [0-9.]*' $OUT/run2/probe_e2e_pdl$pdl.json | paste - - - 
done
