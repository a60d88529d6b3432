#!/bin/bash
# Issue 8 on 2 GPUs: examples/train_ddp.py on bench_e2e's HF Llama (hidden 2048, intermediate
# 5632, 16 layers, ReLU, mlp_bias, gate biases calibrated to density 0.005), 20 steps, bf16
# autocast, AdamW, one fixed global batch of 8 x 2048 tokens (labels = inputs, as bench_e2e
# --train: the loss falls from ~10.8, so a gradient that differs shows) in every configuration:
#   single_{inductor,twell}: 1 GPU, no wrapper, 2 micro-batches of 4 x 2048 (gradient
#                            accumulation: the same tokens and gradient average as 2 ranks x 4)
#   ddp_{inductor,twell}, fsdp2_{inductor,twell}: torchrun, 2 ranks x 4 x 2048 (NCCL)
# twell = twell_compile.prepare + backend="twell" (twell.l1 2e-5), inductor = torch.compile(model).
# Then benchmarks/multi_gpu_summary.py: the README table, speed-ups, loss agreement.
#
#   OUT=$OUT bash benchmarks/run_multi_gpu.sh                  # 2 GPUs, about 6-9 minutes
#   OUT=/tmp/mg DEVICE=cpu TINY=1 bash benchmarks/run_multi_gpu.sh   # CPU (gloo), tiny model
#
# Outputs (8 files): $OUT/runs/<config>.json (6; rewritten after every step, "complete": false
# until a run ends), $OUT/run.log (everything, with "### end <config> rc=N wall_s=S" lines),
# $OUT/multi_gpu_summary.json. PROFILE=N: N more steps per run under torch.profiler, after the
# timed ones: $OUT/traces/<config>/rank<r>.json.gz and benchmarks/trace_overlap.py's
# $OUT/trace_overlap.json (compute, NCCL, exposed NCCL and idle time per step). Each run has a time limit (T_RUN, capped by what is left of
# TOTAL_S for the whole script); a failed or cut run is logged with its rc and the next goes on.
# Env: LAYERS, SEQ, GLOBAL_BATCH, STEPS, WARMUP, DENSITY, CALIB_BATCH, L1, DATA (fixed|random),
# BUCKET_MB (DDP bucket cap; default DDP's 25 MB), PROFILE, CONFIGS (subset, in order; default single,
# FSDP2, DDP), T_RUN, TOTAL_S, NPROC, SKIP_INSTALL, WORK (caches, calibrated gate biases).
set -u
OUT=${OUT:-/tmp/multi_gpu_out}
WORK=${WORK:-/tmp/twell_multi_gpu}
mkdir -p "$OUT/runs" "$WORK"
OUT=$(cd "$OUT" && pwd) WORK=$(cd "$WORK" && pwd)   # absolute: the runs start in the repository root
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
NPROC=${NPROC:-2}
TOTAL_S=${TOTAL_S:-530}      # the whole script, install included (the device allows 9-10 minutes)
RESERVE_S=${RESERVE_S:-15}   # kept for the summary
MIN_RUN_S=${MIN_RUN_S:-25}   # a run given less than this is skipped
LOG=$OUT/run.log
: > "$LOG"
rm -rf "$OUT"/runs/*.json "$OUT/multi_gpu_summary.json" "$OUT/traces" "$OUT/trace_overlap.json"   # nothing stale

# NVLink multicast stays off (set on the machine already; set again, never unset).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# One Inductor/Triton cache for every run: graphs compiled before (an earlier run of the
# script, or the same kernels in another configuration) are warm.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$WORK/inductor_cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$WORK/triton_cache}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # torchrun's default too

if [ -n "${TINY:-}" ]; then   # train_ddp --tiny: hidden 64, 2 layers, ffn 176, 4 heads, vocab 256, seq 32
    SIZE="--tiny"
    GB=${GLOBAL_BATCH:-4}; STEPS=${STEPS:-4}; WARMUP=${WARMUP:-1}; DENSITY=${DENSITY:-0.1}
    CALIB=${CALIB_BATCH:-64}; T_RUN=${T_RUN:-240}
else
    SIZE="--hidden 2048 --ffn 5632 --layers ${LAYERS:-16} --heads 16 --vocab 32000 --seq ${SEQ:-2048}"
    GB=${GLOBAL_BATCH:-8}; STEPS=${STEPS:-20}; WARMUP=${WARMUP:-3}; DENSITY=${DENSITY:-0.005}
    CALIB=${CALIB_BATCH:-256}; T_RUN=${T_RUN:-150}
fi
COMMON=(--device "$DEVICE" $SIZE --global-batch "$GB" --steps "$STEPS" --warmup "$WARMUP"
        --density "$DENSITY" --calib-batch "$CALIB" --calib-cache "$WORK/gate_bias_${DEVICE}${TINY:+_tiny}.pt"
        --l1 "${L1:-2e-5}" --seed "${SEED:-0}")
[ -n "${BUCKET_MB:-}" ] && COMMON+=(--bucket-cap-mb "$BUCKET_MB")
PROFILE=${PROFILE:-0}
[ "${DATA:-fixed}" = fixed ] && COMMON+=(--fixed-batch)   # DATA=random: a fresh global batch per step

{
    echo "### run_multi_gpu.sh $(date -u +%FT%TZ) DEVICE=$DEVICE NPROC=$NPROC TINY=${TINY:-} args: ${COMMON[*]}"
    git log --oneline -1 2>/dev/null
    [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=index,name,memory.total --format=csv 2>&1
    env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS|TORCHINDUCTOR_CACHE_DIR)='
} >> "$LOG" 2>&1
if [ -z "${SKIP_INSTALL:-}" ]; then
    timeout 120 python3 -m pip install -q --no-deps --no-build-isolation -e . >> "$LOG" 2>&1
    echo "### install rc=$? at ${SECONDS}s" | tee -a "$LOG"
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'gpus', torch.cuda.device_count())" >> "$LOG" 2>&1

run() {   # run NAME WRAP BACKEND
    local name=$1 wrap=$2 backend=$3
    local left=$((TOTAL_S - RESERVE_S - SECONDS)) limit=$T_RUN
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt "$MIN_RUN_S" ]; then
        echo "### end $name rc=skipped wall_s=0 (${left}s left of TOTAL_S=$TOTAL_S)" | tee -a "$LOG"
        return
    fi
    local json=$OUT/runs/$name.json from start=$SECONDS rc
    rm -f "$json"
    from=$(($(wc -l < "$LOG") + 1))
    local cmd
    if [ "$wrap" = none ]; then   # 1 device; NPROC micro-batches = one rank's batch each
        cmd=(python3 examples/train_ddp.py --wrap none --accum "$NPROC")
    else
        cmd=(python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" examples/train_ddp.py
             --wrap "$wrap")
    fi
    cmd+=(--backend "$backend" "${COMMON[@]}" --out "$json")
    [ "$PROFILE" -gt 0 ] && cmd+=(--profile "$PROFILE" --profile-dir "$OUT/traces/$name")
    echo "### start $name at ${SECONDS}s, limit ${limit}s: ${cmd[*]}" >> "$LOG"
    # timeout signals its whole process group: torchrun and its workers end together
    timeout -k 10 "$limit" "${cmd[@]}" >> "$LOG" 2>&1
    rc=$?
    echo "### end $name rc=$rc wall_s=$((SECONDS - start))" | tee -a "$LOG"
    if [ "$rc" -ne 0 ]; then
        tail -n "+$from" "$LOG" | grep -v -E '^(step |### )' | tail -n 12
    elif [ -s "$json" ]; then
        python3 - "$json" <<'EOF'
import json, sys
(d,) = json.load(open(sys.argv[1]))   # train_ddp.py --out: a results file of one row
print(f"    loss {d['losses'][0]:.4f} -> {d['losses'][-1]:.4f}, median step {d['median_step_ms']} ms, "
      f"first step {d['first_step_s']} s, peak {d['peak_memory_mb_max']} MB, rewritten per rank "
      f"{[len(r['rewritten']) for r in d['ranks']]}")
EOF
    fi
}

# FSDP2 before DDP: its per-block graphs compile once for all blocks; DDP's graph is split at
# its buckets (16 layers, 25 MB: 82 pieces, each compiled on its own), the slowest to compile.
for name in ${CONFIGS:-single_inductor single_twell fsdp2_inductor fsdp2_twell ddp_inductor ddp_twell}; do
    wrap=${name%_*}
    [ "$wrap" = single ] && wrap=none
    run "$name" "$wrap" "${name#*_}"
done

if [ "$PROFILE" -gt 0 ] && [ "$DEVICE" = cuda ] && [ -d "$OUT/traces" ]; then
    timeout 120 python3 benchmarks/trace_overlap.py --traces "$OUT/traces" --steps "$PROFILE" \
        --out "$OUT/trace_overlap.json" 2>&1 | tee -a "$LOG"
fi
timeout 60 python3 benchmarks/multi_gpu_summary.py --runs "$OUT/runs" --log "$LOG" --nproc "$NPROC" \
    --out "$OUT/multi_gpu_summary.json" 2>&1 | tee -a "$LOG"
echo "### done in ${SECONDS}s"
