#!/bin/bash
# Issue 4 on the device: training GPU tests first (a wrong kernel is not worth timing), then the
# sparse path's stage times (--parts, with a per-kernel profile), the training grid (POINTS=full
# for all 30 points, else the target points) and, unless SKIP_E2E is set, bench_e2e --train at
# full size, once per learning rate in E2E_LRS. Logs and JSON go to a work folder, tarred
# into $OUT/${TAG}train_gpu.tgz (the device returns at most 8 files). PROFILE (below) adds
# profile_train_step.py runs.
OUT=${OUT:-/tmp/train_out}
W=$(mktemp -d /tmp/train_work.XXXX)
mkdir -p "$W"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$W/install.log" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > "$W/tests.log" 2>&1
if [ -z "$SKIP_TESTS" ]; then
    timeout ${T_TEST:-240} python3 -m pytest -q -x tests/runtime/test_cuda_train.py ${EXTRA_TESTS} >> "$W/tests.log" 2>&1
    echo "pytest rc=$?" >> "$W/tests.log"
fi
tail -n 5 "$W/tests.log"
if [ -z "$SKIP_PARTS" ]; then
    timeout ${T_PARTS:-150} python3 benchmarks/bench_ffn_train.py --parts --M 16384 --density 0.005 \
        --tail ${PARTS_TAILS:-0} --reps ${REPS:-50} > "$W/parts.log" 2>&1
    echo "parts rc=$?" >> "$W/parts.log"
    grep -E "^ *16384|best|rc=" "$W/parts.log"
fi
# PROFILE: a list of GPU-record changes ("default", or FIELD=VALUE[,FIELD=VALUE]); each runs
# profile_train_step.py on bench_e2e's 4-layer model with twell.l1=12 (the first also Inductor;
# PROFILE_ARGS: more flags, e.g. --neurons)
first=1
for pol in ${PROFILE:-}; do
    pargs=(); [ "$pol" != default ] && pargs=(--policy ${pol//,/ })
    [ $first = 1 ] || pargs+=(--backends twell)
    timeout ${T_PROFILE:-200} python3 benchmarks/profile_train_step.py --layers 4 --batch 8 --seq 2048 \
        --density 0.005 --twell-opt twell.l1=12 "${pargs[@]}" ${PROFILE_ARGS:-} > "$W/profile_$pol.log" 2>&1
    echo "profile $pol rc=$?" >> "$W/profile_$pol.log"
    grep -E "^===|^  [A-Za-z]|wgrad|rc=" "$W/profile_$pol.log" | grep -v "^  warn"
    first=0
done
if [ "${POINTS:-targets}" = full ]; then
    SEL=""
else
    SEL="--M 16384 65536 --density 0.005 0.02 --tail 0 0.2"
fi
if [ -z "$SKIP_GRID" ]; then
    timeout ${T_GRID:-240} python3 benchmarks/bench_ffn_train.py $SEL --reps ${REPS:-50} ${GRID_ARGS} \
        --out "$W/ffn_training.json" > "$W/grid.log" 2>&1
    echo "grid rc=$?" >> "$W/grid.log"
    cat "$W/grid.log"
fi
if [ -z "$SKIP_E2E" ]; then
    for lr in ${E2E_LRS:-3e-4}; do
        timeout ${T_E2E:-420} python3 benchmarks/bench_e2e.py --train --density 0.005 --lr $lr ${E2E_ARGS} \
            --out "$W/e2e_train_lr$lr.json" > "$W/e2e_train_lr$lr.log" 2>&1
        echo "e2e rc=$?" >> "$W/e2e_train_lr$lr.log"
        tail -n 8 "$W/e2e_train_lr$lr.log"
    done
fi
mkdir -p "$OUT"
tar -czf "$OUT/${TAG}train_gpu.tgz" -C "$W" .
