# Session 11 run 12 (H200): probe_pdl_graph.py (run 11's slow K=4096 M=1 points).
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/run12
timeout 200 python3 benchmarks/results/h200/session11/probe_pdl_graph.py $OUT/run12/probe_pdl_graph.txt 2>&1 | grep -v "Warn\|^---------" | head -90
