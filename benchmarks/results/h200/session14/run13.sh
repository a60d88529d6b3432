#!/usr/bin/env bash
# Session 14 run 13: final code (rule = fit of run 8's grid): the policy-dependent decode GPU
# tests, test_decode_graphs.py, and the compile-level tests.
. benchmarks/results/h200/session14/lib.sh
RUN=run13
setup
final_tests
