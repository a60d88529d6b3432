"""Plots of examples/train_sparse_lm.py runs, from their metrics logs alone.

    python examples/plot_training.py SPARSE_RUN [DENSE_RUN] [--fixed-l1 L1_RUN] --out DIR

SPARSE_RUN / DENSE_RUN / L1_RUN: a run directory (holding metrics.jsonl) or a metrics.jsonl file.
Writes into DIR:
  density_vs_target.png   (SPARSE_RUN trained with --target-density) per-layer density against
                          the target, the fixed-L1 run's (dashed) and each layer's coefficient
  nnz_over_training.png   per-layer mean non-zeros per token over training (dense dashed)
  nnz_distribution.png    non-zeros per token across tokens (histogram) and across sequence
                          positions (mean per position), per layer, from the final probe batch
  val_loss.png            validation (and training) loss, dense vs sparse
Needs matplotlib (``pip install -e '.[examples]'``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional


def read_metrics(path: Path) -> dict[str, list[dict[str, Any]]]:
    """Records of a metrics.jsonl grouped by kind. A resumed run appends to the same log: a
    later record of the same kind and step replaces the earlier one."""
    if path.is_dir():
        path = path / "metrics.jsonl"
    by_kind: dict[str, dict[int, dict[str, Any]]] = {}
    order: dict[str, list[int]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        kind, step = rec.get("kind", "?"), int(rec.get("step", 0))
        if step not in by_kind.setdefault(kind, {}):
            order.setdefault(kind, []).append(step)
        by_kind[kind][step] = rec
    return {k: [by_kind[k][s] for s in sorted(order[k])] for k in by_kind}


def _label(m: dict[str, list[dict[str, Any]]], fallback: str) -> str:
    cfg = (m.get("config") or [{}])[-1]
    l1 = cfg.get("l1")
    return f"{fallback} (L1={l1:g})" if isinstance(l1, (int, float)) else fallback


def _short(layer: str) -> str:
    parts = layer.split(".")
    return f"layer {parts[2]}" if len(parts) > 2 and parts[2].isdigit() else layer



def _save(fig, path: Path) -> Path:
    """Lay out, write (110 dpi) and close a figure; returns its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

def plot_nnz_over_training(sparse, dense, out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    train = sparse.get("train", [])
    layers = list(train[-1]["nnz_per_token"]) if train else []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, layer in enumerate(layers):
        c = colors[i % len(colors)]
        ax.plot([r["step"] for r in train], [r["nnz_per_token"][layer] for r in train], color=c,
                label=f"{_short(layer)} sparse")
        if dense and dense.get("train"):
            dt = dense["train"]
            ax.plot([r["step"] for r in dt], [r["nnz_per_token"].get(layer, float("nan")) for r in dt], color=c,
                    ls="--", alpha=0.6, label=f"{_short(layer)} dense")
    hidden = train[-1].get("hidden") if train else None
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("mean non-zeros per token" + (f" (of {hidden})" if hidden else ""))
    ax.set_title(f"FFN activity during training: {_label(sparse, 'sparse')}" + (" vs dense (dashed)" if dense else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out / "nnz_over_training.png")


def plot_nnz_distribution(sparse, dense, out: Path) -> Optional[Path]:
    import matplotlib.pyplot as plt

    if not sparse.get("final"):
        return None
    nnz = sparse["final"][-1]["nnz"]
    dnnz = dense["final"][-1]["nnz"] if dense and dense.get("final") else {}
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (layer, s) in enumerate(nnz.items()):
        c = colors[i % len(colors)]
        vals, cnts = s["hist_values"], s["hist_counts"]
        # Fraction of tokens with at least v non-zeros (complementary CDF): shows the long tail.
        total, acc, ccdf = sum(cnts), 0, []
        for n in cnts:
            ccdf.append(1 - acc / total)
            acc += n
        a.step([max(v, 0.5) for v in vals], ccdf, where="post", color=c,
               label=f"{_short(layer)}: mean {s['mean']:.1f}, p99 {s['quantiles']['0.99']:.0f}, max {s['quantiles']['1.0']:.0f}")
        if layer in dnnz:
            d = dnnz[layer]
            dt, dacc, dcc = sum(d["hist_counts"]), 0, []
            for n in d["hist_counts"]:
                dcc.append(1 - dacc / dt)
                dacc += n
            a.step([max(v, 0.5) for v in d["hist_values"]], dcc, where="post", color=c, ls="--", alpha=0.5)
        pos = s["per_position_mean"]
        b.plot(range(len(pos)), pos, color=c, label=_short(layer))
    hidden = next(iter(nnz.values()))["hidden"]
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel(f"non-zeros per token (of {hidden})")
    a.set_ylabel("fraction of tokens with >= x non-zeros")
    a.set_title("across tokens (final probe; dense dashed)" if dnnz else "across tokens (final probe)")
    a.grid(True, which="both", alpha=0.3)
    a.legend(fontsize=7)
    b.set_yscale("log")
    b.set_xlabel("position in sequence")
    b.set_ylabel("mean non-zeros per token")
    b.set_title("across sequence positions (sparse run)")
    b.grid(True, which="both", alpha=0.3)
    b.legend(fontsize=7, ncol=2)
    fig.suptitle(f"Distribution of FFN non-zeros, {_label(sparse, 'sparse')}, "
                 f"{next(iter(nnz.values()))['tokens']} tokens of validation text")
    return _save(fig, out / "nnz_distribution.png")


def plot_val_loss(sparse, dense, out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for m, name, c in ((sparse, "sparse", "C0"), (dense, "dense", "C1")):
        if not m:
            continue
        ev, tr = m.get("eval", []), m.get("train", [])
        if ev:
            ax.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o-", color=c,
                    label=f"{_label(m, name)} validation: final {ev[-1]['val_loss']:.3f}")
        if tr:
            ax.plot([r["step"] for r in tr], [r["train_loss"] for r in tr], color=c, alpha=0.3, lw=1,
                    label=f"{name} train")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title("Loss, dense vs sparse" if dense else "Loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ev = [r["val_loss"] for m in (sparse, dense) if m for r in m.get("eval", [])]
    late_train = [r["train_loss"] for m in (sparse, dense) if m for r in m.get("train", [])[len(m.get("train", [])) // 2:]]
    if ev:
        lo = min(ev + late_train)
        ax.set_ylim(lo - 0.3, max(ev[len(ev) // 4:] + [lo + 1.5]) + 0.3)
    return _save(fig, out / "val_loss.png")


def plot_density_vs_target(sparse, fixed, out: Path) -> Optional[Path]:
    """Per-layer density of a --target-density run against its target (and a fixed-L1 run's,
    dashed), and each layer's coefficient (twell.l1's units)."""
    import matplotlib.pyplot as plt

    train = sparse.get("train", [])
    if not train or "target_density" not in train[-1]:
        return None
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(7.5, 7), sharex=True)
    layers = list(train[-1]["density"])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    target = train[-1]["target_density"]
    steps = [r["step"] for r in train]
    for i, layer in enumerate(layers):
        c = colors[i % len(colors)]
        ax.plot(steps, [r["density"][layer] for r in train], color=c, label=f"{_short(layer)} target run")
        if fixed and fixed.get("train"):
            ft = fixed["train"]
            ax.plot([r["step"] for r in ft], [r["density"].get(layer, float("nan")) for r in ft], color=c, ls="--",
                    alpha=0.6, label=f"{_short(layer)} l1 {ft[-1].get('l1')}")
        bx.plot(steps, [r["l1_coef"][layer] for r in train], color=c, label=_short(layer))
    ax.axhline(target, color="k", lw=1)
    ax.axhspan(0.75 * target, 1.25 * target, color="k", alpha=0.08, label="target +-25%")
    ax.set_yscale("log")
    ax.set_ylabel("density (fraction of hidden units active per token)")
    ax.set_title(f"twell.target_density {target}" + (" vs a fixed twell.l1 (dashed)" if fixed else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    bx.set_yscale("log")
    bx.set_xlabel("step")
    bx.set_ylabel("L1 coefficient (twell.l1's units)")
    bx.grid(True, which="both", alpha=0.3)
    bx.legend(fontsize=7, ncol=2)
    return _save(fig, out / "density_vs_target.png")


def make_plots(sparse_run: Path, dense_run: Optional[Path], out: Path, fixed_run: Optional[Path] = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    sparse = read_metrics(Path(sparse_run))
    dense = read_metrics(Path(dense_run)) if dense_run else None
    fixed = read_metrics(Path(fixed_run)) if fixed_run else None
    paths = [plot_nnz_over_training(sparse, dense, out), plot_nnz_distribution(sparse, dense, out),
             plot_val_loss(sparse, dense, out), plot_density_vs_target(sparse, fixed, out)]
    return [p for p in paths if p is not None]


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sparse", type=Path, help="sparse run directory or its metrics.jsonl")
    ap.add_argument("dense", type=Path, nargs="?", help="dense baseline run directory or metrics.jsonl")
    ap.add_argument("--fixed-l1", type=Path, help="a fixed-L1 run to compare a --target-density run with")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    for p in make_plots(args.sparse, args.dense, args.out, args.fixed_l1):
        print(p)


if __name__ == "__main__":
    main()
