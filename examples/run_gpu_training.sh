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

from benchmarks.rows import stamp, write_json   # run from the checkout's root: the results row schema

out = sys.argv[1]
def recs(run, kind):
    return [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl") if json.loads(l)["kind"] == kind]
s, d = recs("sparse", "final")[-1], recs("dense", "final")[-1]
# One row per run (benchmarks/rows.py's schema; torch from the run's config record), the sparse
# run's against the dense one on its row.
rows = [stamp(dict(run="sparse", val_loss=s["val_loss"], val_loss_rel_vs_dense=(s["val_loss"] - d["val_loss"]) / d["val_loss"],
                   mean_nnz_per_token=s["mean_nnz_per_token"], mean_density=s["mean_density"],
                   per_layer_nnz={k: v["mean"] for k, v in s["nnz"].items()},
                   dead_frac_final_probe=s["dead_frac_final_probe"], dead_checks=recs("sparse", "dead"),
                   wall_s=s["wall_s"], bench=(recs("sparse", "bench") or [None])[-1]),
              torch=recs("sparse", "config")[-1]["torch"]),
        stamp(dict(run="dense", val_loss=d["val_loss"], mean_nnz_per_token=d["mean_nnz_per_token"],
                   wall_s=d["wall_s"], bench=(recs("dense", "bench") or [None])[-1]),
              torch=recs("dense", "config")[-1]["torch"])]
write_json(f"{out}/summary.json", rows)
print(json.dumps([{k: v for k, v in r.items() if k != "dead_checks"} for r in rows], indent=1))
PY
