#!/usr/bin/env bash
# Session 14 run 15: final code (rule = fit of run 14's grid, pairs term by row blocks): the
# policy-dependent decode GPU tests and the compile-level tests, as run 13.
. benchmarks/results/h200/session14/lib.sh
RUN=run15
setup
final_tests
