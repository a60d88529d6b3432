#!/usr/bin/env bash
# Session 14 run 8: the grid under the rule refitted to run 7's grid with tiles' atomics term
# (cuda_policy.tiles_active) and least relative error for every form.
. benchmarks/results/h200/session14/lib.sh
RUN=run8
setup
grid ffn_decode grid
fit ffn_decode fit
