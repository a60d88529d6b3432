#!/bin/bash
# Session 16 run 6: run 5's steps again on the final rules (a user's mark_dynamic range is never
# narrowed), into run6/.
R=${OUT:-/tmp}/run6 bash benchmarks/results/h200/session16/run5.sh
