#!/bin/bash
# Session 9, device call 6: bench_e2e's step loop again at batch 8 and 16 (run 4: b8 0.999x,
# b16 cut by the time limit), and the profiled steady-state probe at batch 16.
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1
for B in 8 16; do
    timeout 170 python3 benchmarks/bench_e2e.py --generate --step-loop --batch $B --seq 128 --new-tokens 128 \
        --density 0.005 --no-energy --reps 5 --out $OUT/e2e_generate_b$B.json > $OUT/e2e_b$B.log 2>&1
    echo "e2e b$B rc=$?" >> $OUT/e2e_b$B.log
    grep -E "step loop|decode |x decode|x step|rc=" $OUT/e2e_b$B.log
done
timeout 150 python3 benchmarks/results/h200/session9/probe_e2e.py $OUT/probe_e2e_b16.json 16 > $OUT/probe_e2e_b16.log 2>&1
echo "probe rc=$?"
grep -o '"batch": [0-9]*, "backend": "[a-z]*", "wall_ms_per_step": [0-9.]*, "kernel_ms_per_step": [0-9.]*' $OUT/probe_e2e_b16.log
