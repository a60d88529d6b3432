"""Session 18: the sparse backward with each neuron's entries sorted by row (cuda_train.WG_SORT)
against the atomic ranks' order, and the wgrad passes' configs on the sorted order; one process,
interleaved rounds. Also the gradients' largest relative difference between the orders.

    python3 benchmarks/results/h100/session18/probe_sort.py OUT.json
"""
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from synthetic import make_ffn  # noqa: E402
from timing import interleaved_ms  # noqa: E402

from twell_compile.kernels import cuda_train as ct  # noqa: E402
from twell_compile.kernels.torch_impl import backup_capacity  # noqa: E402

# (WG_SORT, WG_DY_ENTRIES, WG_DY_COLS_PER_WARP, WG_X_ENTRIES, WG_X_WARPS)
VARIANTS = {"unsorted": (False, 4, 512, 4, 4), "sorted": (True, 4, 512, 4, 4),
            "sorted_dy1w2_x2w2": (True, 1, 1024, 2, 2), "sorted_dy2w4_x2w4": (True, 2, 512, 2, 4),
            "sorted_dy2w2_x4w2": (True, 2, 1024, 4, 2)}
NAMES = ("WG_SORT", "WG_DY_ENTRIES", "WG_DY_COLS_PER_WARP", "WG_X_ENTRIES", "WG_X_WARPS")


def setv(v):
    for name, val in zip(NAMES, v):
        setattr(ct, name, val)


def main():
    rows = []
    k, n = 2048, 5632
    shipped = tuple(getattr(ct, nm) for nm in NAMES)
    for m, d, t in [(16384, 0.005, 0.0), (16384, 0.005, 0.2), (65536, 0.005, 0.0), (65536, 0.005, 0.2)]:
        p = make_ffn(m, k, n, d, t, device="cuda", seed=1)
        x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
        dy = torch.randn(m, k, device="cuda", dtype=x.dtype)
        w, cap = 256, int(backup_capacity(m, 16))
        _, _, *st, _ = ct.forward_sparse(x, wg, None, wu, None, wd, None, w, cap)
        grads = {}

        def bwd(v):
            def f():
                setv(v)
                return ct.backward_sparse(dy, x, wg, None, wu, None, wd, *st, 0.0)
            return f
        fns = {name: bwd(v) for name, v in VARIANTS.items()}
        for name, f in fns.items():
            grads[name] = [g for g in f() if g is not None]
        fwd = lambda: ct.forward_sparse(x, wg, None, wu, None, wd, None, w, cap)
        fns["forward"] = fwd
        t_ms = interleaved_ms(fns, 200, 5)
        setv(shipped)
        base = grads["unsorted"]
        diff = {name: max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(g, base))
                for name, g in grads.items()}
        row = dict(M=m, density=d, tail=t, ms=t_ms, grad_diff_vs_unsorted=diff, gpu=torch.cuda.get_device_name())
        rows.append(row)
        print(m, d, t, " ".join(f"{kk} {v:.3f}" for kk, v in t_ms.items()), "diff", {kk: f"{v:.1e}" for kk, v in diff.items()}, flush=True)
        del p, x, wg, wu, wd, dy, st, grads
        torch.cuda.empty_cache()
    Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
