#!/usr/bin/env bash
# The training recipe on one GPU: sparse (twell L1) and dense-ReLU runs of the gpu preset, plots, the real
# non-zeros-per-token profile, and the inference forward inductor vs twell on the trained model.
#
#   bash examples/run_gpu_training.sh OUT_DIR
#
# Budget: each run stops by itself after --steps (1500 at the gpu preset); the two together are
# sized for <= 6 minutes on one H100 (docs/training.md, "Sizing"). Everything lands in OUT_DIR.
set -euo pipefail
OUT=${1:?usage: run_gpu_training.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."

python3 -m pip install -q --no-deps --no-build-isolation -e .
python3 -c "import matplotlib" 2>/dev/null || python3 -m pip install -q matplotlib || echo "no matplotlib: plots skipped"
python3 - <<'PY' | tee "$OUT/env.txt"
import sys, torch, transformers, tokenizers
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
      "tokenizers", tokenizers.__version__, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
PY

# Dense baseline first (same seed, data order and settings; L1 = 0), then the sparse run,
# which also plots against the dense one and writes the profile. Both time the inference forward.
python3 examples/train_sparse_lm.py --preset gpu --out "$OUT/dense" --cache-dir "$OUT/cache" --baseline --time-limit-min 2.5 \
    --bench-forward --no-progress 2>&1 | tee "$OUT/dense.log"
python3 examples/train_sparse_lm.py --preset gpu --out "$OUT/sparse" --cache-dir "$OUT/cache" --reinit-dead --time-limit-min 2.5 \
    --dense-run "$OUT/dense" --profile-out "$OUT/nnz_profile.json" --bench-forward --no-progress 2>&1 | tee "$OUT/sparse.log"

# The plots again from the two logs alone (examples/plot_training.py can remake them anywhere).
python3 examples/plot_training.py "$OUT/sparse" "$OUT/dense" --out "$OUT/plots" || echo "plots failed (matplotlib?)"

# Small outputs to copy into docs/ (checkpoints stay in $OUT/*/ckpt).
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def recs(run, kind):
    return [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl") if json.loads(l)["kind"] == kind]
s, d = recs("sparse", "final")[-1], recs("dense", "final")[-1]
summary = dict(val_loss_sparse=s["val_loss"], val_loss_dense=d["val_loss"],
               val_loss_rel=(s["val_loss"] - d["val_loss"]) / d["val_loss"],
               mean_nnz_sparse=s["mean_nnz_per_token"], mean_density_sparse=s["mean_density"],
               mean_nnz_dense=d["mean_nnz_per_token"], per_layer_nnz_sparse={k: v["mean"] for k, v in s["nnz"].items()},
               dead_frac_final_probe_sparse=s["dead_frac_final_probe"], dead_checks_sparse=recs("sparse", "dead"),
               wall_s_sparse=s["wall_s"], wall_s_dense=d["wall_s"],
               bench_sparse=(recs("sparse", "bench") or [None])[-1], bench_dense=(recs("dense", "bench") or [None])[-1])
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps({k: v for k, v in summary.items() if k != "dead_checks_sparse"}, indent=1))
PY
