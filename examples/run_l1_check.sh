#!/usr/bin/env bash
# Issue 6 check on one GPU: the dense-ReLU baseline and the L1 = 3 sparse training, same code,
# same settings (gpu preset, --reinit-dead, seed 0), one after the other; plots; a summary (val
# loss dense vs sparse, density, dead fraction, forward speed-up). The H200 outputs of
# 2026-11-22 are in benchmarks/results/h200/recipe/ (docs/training.md, "GPU results").
#
#   bash examples/run_l1_check.sh OUT_DIR [--with-inductor-dense]
#
# --with-inductor-dense: a third run, the same dense baseline with --backend inductor (no twell
#   op at all), as the reference for twell's dense training path (~1.5 min more on an H200).
# Environment overrides (for a CPU smoke test): PRESET (gpu), L1 (3), TIME_LIMIT_MIN (2.0: a
#   guard per run; a run it stops is flagged in the summary), BENCH (1: --bench-forward on the
#   sparse run), BENCH_BATCH (32 sequences = 16384 tokens, at or over the 8192 where twell keeps
#   an inference FFN rewritten; at 8 x 512 = 4096 tokens twell.skip_dense leaves every FFN to
#   Inductor and both backends time the same code), WORK (scratch for
#   checkpoints and the token cache, default /tmp/twell_l1_check), EXTRA (more
#   train_sparse_lm.py flags, given to every run). CPU smoke test (~4-5 minutes on 2 cores):
#   PRESET=cpu-tiny EXTRA="--steps 40 --eval-every 20 --dead-probe-every 10 --dead-check-every 20 --threads 2" \
#       bash examples/run_l1_check.sh /tmp/l1chk --with-inductor-dense
#
# Budget: on an H200 each run took 79-96 s for 1500 steps with compilation (docs/training.md);
# both runs, the forward benchmark and the plots are sized for <= 6 minutes. OUT_DIR gets only
# small files, flat: run.log, summary.json, {dense,sparse[,inductor]}_metrics.jsonl, 3 PNGs;
# checkpoints and the token cache stay in WORK.
set -euo pipefail
OUT=${1:?usage: run_l1_check.sh OUT_DIR [--with-inductor-dense]}
INDUCTOR_DENSE=0
if [ "${2:-}" = "--with-inductor-dense" ]; then INDUCTOR_DENSE=1; elif [ -n "${2:-}" ]; then echo "unknown option $2" >&2; exit 2; fi
PRESET=${PRESET:-gpu}
L1=${L1:-3}
TIME_LIMIT_MIN=${TIME_LIMIT_MIN:-2.0}
BENCH=${BENCH:-1}
BENCH_BATCH=${BENCH_BATCH:-32}
WORK=${WORK:-/tmp/twell_l1_check}
EXTRA=${EXTRA:-}
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."

main() {
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
    python3 -c "import matplotlib" 2>/dev/null \
        || python3 -m pip install -q --retries 0 --timeout 5 matplotlib 2>/dev/null || echo "no matplotlib: plots skipped"
    python3 - <<'PY'
import sys, torch, transformers, tokenizers
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
      "tokenizers", tokenizers.__version__, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
PY
    git log -1 --format='code: %h %s' 2>/dev/null | cut -c1-120 || true
    rm -rf "$WORK/dense" "$WORK/sparse" "$WORK/inductor" "$WORK/plots"

    # Identical flags for every run (the first L1 = 3 training on the H200, 2026-11-22, had these
    # with --time-limit-min 1.5, which it did not reach); only the L1 coefficient (and the
    # backend of the optional third run) differs.
    common=(--preset "$PRESET" --cache-dir "$WORK/cache" --reinit-dead --time-limit-min "$TIME_LIMIT_MIN"
            --keep-ckpts 1 --no-plots --no-progress)
    # shellcheck disable=SC2206
    extra=($EXTRA)
    bench=()
    if [ "$BENCH" = 1 ]; then bench=(--bench-forward --bench-batch "$BENCH_BATCH"); fi

    echo "== dense baseline (L1 = 0, twell backend)"
    python3 examples/train_sparse_lm.py --out "$WORK/dense" --baseline "${common[@]}" "${extra[@]}"
    echo "== sparse (L1 = $L1, twell backend)"
    python3 examples/train_sparse_lm.py --out "$WORK/sparse" --l1 "$L1" "${common[@]}" "${bench[@]}" "${extra[@]}"
    if [ "$INDUCTOR_DENSE" = 1 ]; then
        echo "== dense baseline (L1 = 0, inductor backend: no twell op)"
        python3 examples/train_sparse_lm.py --out "$WORK/inductor" --baseline --backend inductor "${common[@]}" "${extra[@]}"
    fi

    for r in dense sparse inductor; do
        if [ -f "$WORK/$r/metrics.jsonl" ]; then cp "$WORK/$r/metrics.jsonl" "$OUT/${r}_metrics.jsonl"; fi
    done
    python3 examples/plot_training.py "$WORK/sparse" "$WORK/dense" --out "$WORK/plots" >/dev/null \
        && cp "$WORK"/plots/*.png "$OUT/" || echo "plots failed (matplotlib?)"

    python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path

from benchmarks.rows import stamp, write_json   # run from the checkout's root: the results row schema

out = Path(sys.argv[1])

def load(p):
    p = Path(p)
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else None

def last(recs, kind):
    r = [x for x in recs if x["kind"] == kind]
    return r[-1] if r else None

def run_summary(recs):
    f, cfg = last(recs, "final") or {}, last(recs, "config")
    train = [x for x in recs if x["kind"] == "train"]
    comp = last(recs, "compile")
    return dict(
        val_loss=f.get("val_loss"), step=f.get("step"), stopped_by_time_limit=f.get("stopped_by_time_limit"),
        mean_nnz_per_token=f.get("mean_nnz_per_token"), mean_density=f.get("mean_density"),
        per_layer_nnz={k: v["mean"] for k, v in f.get("nnz", {}).items()},
        dead_frac_final_probe=f.get("dead_frac_final_probe"),
        dead_checks=[(x["step"], x["dead_frac"], x.get("dead_frac_after")) for x in recs if x["kind"] == "dead"],
        val_curve={x["step"]: x["val_loss"] for x in recs if x["kind"] == "eval"},
        train_loss_last=train[-1]["train_loss"] if train else None,
        ffns_on_twell_op=len(train[-1]["nnz_per_token"]) if train else None,   # 0: all left to Inductor
        tokens_per_s_median=statistics.median(x["tokens_per_s"] for x in train) if train else None,
        compile_s=comp["compile_s"] if comp else None, wall_s=f.get("wall_s"),
        backend=cfg["backend"], l1=cfg["l1"])

runs = {r: load(out / f"{r}_metrics.jsonl") for r in ("dense", "sparse", "inductor")}
runs = {r: v for r, v in runs.items() if v}
s = {r: run_summary(v) for r, v in runs.items()}
# Every setting except the intended ones must agree between the runs.
cfgs = {r: last(v, "config") for r, v in runs.items()}
intended = {"out", "baseline", "l1", "backend", "bench_forward", "bench_batch", "bench_iters", "step", "resumed_from"}
diff = {k: {r: c.get(k) for r, c in cfgs.items()} for k in set().union(*cfgs.values())
        if k not in intended and len({json.dumps(c.get(k)) for c in cfgs.values()}) > 1}
# One row per run (benchmarks/rows.py's schema; torch from the run's own config record): the
# comparisons go on the row they compare (the sparse run against the dense one, the dense twell
# run against the inductor one), the forward benchmark on the sparse run's row.
summary = {}
d, sp = s.get("dense", {}).get("val_loss"), s.get("sparse", {}).get("val_loss")
if d and sp:
    summary["val_loss_rel_sparse_vs_dense"] = (sp - d) / d
    summary["within_3pct"] = abs(sp - d) / d <= 0.03
if d and s.get("inductor", {}).get("val_loss"):
    summary["val_loss_rel_dense_twell_vs_inductor"] = (d - s["inductor"]["val_loss"]) / s["inductor"]["val_loss"]
bench = last(runs["sparse"], "bench") if "sparse" in runs else None
rows = []
for r, v in s.items():
    row = stamp(dict(run=r, **v, config_differences_besides_l1_backend=diff), torch=cfgs[r]["torch"])
    if r == "sparse":
        row.update({k: summary[k] for k in ("val_loss_rel_sparse_vs_dense", "within_3pct") if k in summary},
                   bench=bench)
    if r == "dense" and "val_loss_rel_dense_twell_vs_inductor" in summary:
        row["val_loss_rel_dense_twell_vs_inductor"] = summary["val_loss_rel_dense_twell_vs_inductor"]
    rows.append(row)
write_json(out / "summary.json", rows)

fmt = lambda v, f=".4f": "-" if v is None else format(v, f)
print("\n== summary (" + str(out / "summary.json") + ")")
for r, v in s.items():
    print(f"{r:9s} backend={v['backend']} L1={v['l1']:g}: val loss {fmt(v['val_loss'])} at step {v['step']}"
          f"{' (STOPPED BY TIME LIMIT)' if v['stopped_by_time_limit'] else ''}, nnz/token {fmt(v['mean_nnz_per_token'], '.2f')}"
          f" (density {fmt(100 * v['mean_density'] if v['mean_density'] is not None else None, '.3f')}%),"
          f" dead {fmt(100 * v['dead_frac_final_probe'] if v['dead_frac_final_probe'] is not None else None, '.1f')}%,"
          f" train loss {fmt(v['train_loss_last'], '.3f')}, {fmt(v['tokens_per_s_median'], '.0f')} tok/s,"
          f" FFNs on twell op {v['ffns_on_twell_op']}, wall {fmt(v['wall_s'], '.0f')} s")
    print(f"{'':9s} val curve: " + ", ".join(f"{k}: {val:.3f}" for k, val in v["val_curve"].items()))
if "val_loss_rel_sparse_vs_dense" in summary:
    print(f"sparse vs dense: {100 * summary['val_loss_rel_sparse_vs_dense']:+.2f}% relative "
          f"({'within' if summary['within_3pct'] else 'NOT within'} 3%)")
if "val_loss_rel_dense_twell_vs_inductor" in summary:
    print(f"dense twell vs dense inductor: {100 * summary['val_loss_rel_dense_twell_vs_inductor']:+.2f}% relative")
if steps := {v["step"] for v in s.values()} - {None}:
    if len(steps) > 1:
        print(f"WARNING: the runs ended at different steps {sorted(steps)}: compare the val curves instead")
if diff:
    print(f"WARNING: settings differ between runs: {diff}")
if bench and "speedup_twell_vs_inductor" in bench:
    print(f"forward on the sparse model, batch {bench['batch']} {bench['dtype']}: inductor {bench['inductor']['median_ms']:.2f} ms,"
          f" twell {bench['twell']['median_ms']:.2f} ms, speed-up {bench['speedup_twell_vs_inductor']:.2f}x"
          f" (max |logits - eager| {bench['inductor']['max_abs_diff_vs_eager']:.3g} / {bench['twell']['max_abs_diff_vs_eager']:.3g})")
elif bench:
    print(f"forward bench failed: {bench.get('error')}")
PY
}

main 2>&1 | tee "$OUT/run.log"
