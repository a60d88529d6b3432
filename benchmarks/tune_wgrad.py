"""A/B of record variants on the sparse backward's two per-neuron weight-gradient passes
(``cuda_train.sparse_bwd_dy_pass`` and ``sparse_bwd_x_pass``, kernels/twell_train_wgrad.py):
the numbers behind the record's wg_* launch sizes (runtime/arch.py).

    python3 benchmarks/tune_wgrad.py --M 16384 --variants wg_programs_per_sm=8 wg_programs_per_sm=4 \\
        wg_dy_entries=2 --out benchmarks/results/<gpu>/tune_wgrad.json

A variant is a space-free list of FIELD=VALUE pairs joined by "," (GpuPolicy fields, as --policy
elsewhere); the first is the baseline. Inputs: bench_ffn_train.py's (timing.train_inputs: bf16,
gated, no biases, i.i.d. activity at --density, dy random), the sparse forward's state made once.
Per variant the backward's setup runs under the variant's record, then each pass is timed by
do_bench (CUDA events) in interleaved rounds with every other variant's (timing.interleaved_ms;
a timed call zeroes its pass's ticket first, a few bytes). Before timing, one setup + DY pass + X
pass per variant is compared with the baseline's: dW_d^T, dW_g, dW_u and d_g, d_u at the slots the
DY pass writes (``equal``: bit for bit; ``max_rel``: the largest relative norm of a difference). One row per (M, variant): dy_ms, x_ms, their sum.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):                  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.rows import save_rows, stamp  # noqa: E402
from benchmarks.timing import gpu_name, interleaved_ms, policy_changes, train_inputs  # noqa: E402

from twell_compile.config import TwellConfig  # noqa: E402
from twell_compile.formats import backup_capacity  # noqa: E402
from twell_compile.runtime import arch, cuda_train  # noqa: E402
from twell_compile.runtime.launch import unit_rows  # noqa: E402


def _outputs(st) -> list[torch.Tensor]:
    """The passes' results: the weight gradients, and d_g, d_u at the quiet rows' slots (the
    only slots the DY pass writes; the rest of those buffers is never written or read)."""
    written = torch.arange(st.width, device=st.q.device)[None, :] < st.q[:, None]   # q: -1 for busy rows
    return [st.dwdt, st.dwg, st.dwu, st.eg[written], st.eu[written]]


def point(a, m: int, variants: dict[str, dict]) -> list[dict]:
    dev, dt = torch.device("cuda"), torch.bfloat16
    cfg = TwellConfig()
    x, wg, wu, wd, dy = train_inputs(m, a.K, a.N, a.density, 0.0, hash((m, a.K, a.N, a.density, 0.0)) & 0xFFFF,
                                     dev, dt)
    xd, wgd, wdd, wud = x.detach(), wg.detach(), wd.detach(), unit_rows(wu.detach())
    width, cap = min(cfg.ell_width, a.N), int(backup_capacity(m, cfg.backup_rows))
    state = cuda_train.forward_sparse(xd, wgd, None, wud, None, wdd, None, width, cap)[2:-1]
    cnt = state[0]

    def setup():
        return cuda_train.sparse_bwd_setup(dy, xd, wgd, None, wud, None, wdd, *state, 0.0)

    base, fns, checks = None, {}, {}
    for name, patch in variants.items():
        with arch.patched(**patch):
            st = setup()
            cuda_train.sparse_bwd_dy_pass(st)
            cuda_train.sparse_bwd_x_pass(st)
            out = [t.clone() for t in _outputs(st)]
            if base is None:
                base = out
            equal = all(torch.equal(o, b) for o, b in zip(out, base))
            worst = max(float((o.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
                        for o, b in zip(out, base))
            checks[name] = (equal, worst)
            st = setup()                       # the timed state: made under the variant's record

            def dy_pass(st=st):
                st.tickets[:1].zero_()
                cuda_train.sparse_bwd_dy_pass(st)

            def x_pass(st=st):
                st.tickets[1:].zero_()
                cuda_train.sparse_bwd_x_pass(st)

            fns[name + "/dy"], fns[name + "/x"] = dy_pass, x_pass
    ms = interleaved_ms(fns, a.reps, rounds=a.rounds)
    rows = []
    nnz = float(cnt.float().mean())
    for name in variants:
        dy_ms, x_ms = ms[name + "/dy"], ms[name + "/x"]
        equal, worst = checks[name]
        rows.append(stamp(dict(M=m, K=a.K, N=a.N, density=a.density, tail=0.0, nnz_per_row=round(nnz, 2),
                               variant=name, dy_ms=dy_ms, x_ms=x_ms, wgrad_ms=dy_ms + x_ms, equal=equal,
                               max_rel=worst)))
        print(f"M={m} {name:48s} DY {dy_ms:.4f} ms  X {x_ms:.4f} ms  sum {dy_ms + x_ms:.4f}  "
              f"{'bit-equal' if equal else f'max rel {worst:.1e}'}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, nargs="+", default=[16384])
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--N", type=int, default=5632)
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--variants", nargs="+", required=True, metavar="F=V[,F=V...]")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=300, help="do_bench ms per variant and pass, over all rounds")
    ap.add_argument("--out", default=None, help="results JSON (default runs/<gpu>/tune_wgrad.json)")
    a = ap.parse_args(argv)
    variants = {v: policy_changes(v.split(",")) for v in a.variants}
    if not torch.cuda.is_available():
        raise SystemExit("tune_wgrad.py times the CUDA training kernels: it needs a GPU")
    rows = [r for m in a.M for r in point(a, m, variants)]
    save_rows(rows, a.out, gpu_name(), "tune_wgrad.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
