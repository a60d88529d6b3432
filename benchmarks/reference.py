"""The paper's kernels (SakanaAI/sparser-faster-llms) on one point, in a process of their own:
the reference gives wrong output on long tails and crashes on some points, and a crash must
not take the benchmark with it. Never vendored: DIR is the ``sparser-faster-llms`` folder
carried to the GPU machine (../shared/anchor/README.md).

    python3 -m benchmarks.reference DIR M K N DENSITY TAIL SEED [--reps MS] [--rounds R]
    python3 -m benchmarks.reference --train DIR M K N DENSITY TAIL SEED [--reps MS] [--device D]
    python3 -m benchmarks.reference --train-parts DIR M K N DENSITY TAIL SEED [--reps MS] [--rounds R]

Inference (TwELLGatedMLP) prints one line ``REF {"ref_ms": ..., "ref_rel_err": ...,
"ref_nan": ...}`` for the inputs twell_compile.testing.make_ffn(M, K, N, DENSITY, TAIL,
seed=SEED) builds (the same bits as the calling benchmark's: the generator is seeded per
point). bench_ffn.py --reference DIR calls ``run_point`` per point; ``build`` compiles the
reference's extension once, up front (about 90 s with 12 jobs).

--train (the hybrid training op, torch.ops.sparse_ops.ff_forward_gated, forward + backward
through autograd) prints ``REF {"ref_ms": ..., "ref_mib": ..., "ref_grad_rel_err": ...,
"ref_grad_rel_errs": {"x": ..., "w_gate": ..., "w_up": ..., "w_down": ...}}`` on
bench_ffn_train.py's inputs (``train_inputs``: x, weights and dy), timed, its peak memory taken
and its gradients checked as bench_ffn_train.py does ours. bench_ffn_train.py --reference DIR
calls ``run_train_point`` per point and ``build_train`` once. (--device cpu: for the tests'
stand-in reference only.)

--train-parts (benchmarks/train_parts.py --reference DIR) prints ``REF {"parts": [{"part": ...,
"ms": ..., "method": ..., "launches": ...}, ...]}`` for the same op on the same inputs: its
forward alone (under no_grad; do_bench), forward + backward (do_bench), the backward alone
after a fresh forward each sample (CUDA events, ``timing.after_ms``: their backward consumes
the forward's saved state, so it cannot be repeated on one) and step - forward; then, unless
--no-kernels, the device time of each part of a step from torch.profiler (``timing.kernel_phases``:
their launches labelled by ``classify_paper``, PAPER_KERNEL_PARTS), the only way into the pieces
of their op, which exposes the forward and the backward whole.

A point that dies reads ``ref_status`` "crashed rc=N: <last stderr line>" (rc < 0: killed by
a signal, named), one past its timeout "timeout"; its figures are NaN.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
NAN = float("nan")
GRADS = ("x", "w_gate", "w_up", "w_down")      # the order of bench_ffn_train.py's gradients


def _find(ref_dir: str, sub: str, name: str) -> Path:
    path = Path(ref_dir) / "custom_models" / sub
    if not (path / name).is_file():
        raise ValueError(f"--reference {ref_dir!r}: no custom_models/{sub}/{name} there; pass the "
                         "sparser-faster-llms folder (../shared/anchor/README.md shows how to carry it)")
    return path


def _ref_path(ref_dir: str) -> Path:
    return _find(ref_dir, "twell_modules", "twell.py")


def _train_path(ref_dir: str) -> Path:
    return _find(ref_dir, "hybrid_modules", "sparse_ops_loader.py")


def child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _build(code: str, timeout: float) -> str:
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=child_env())
    except subprocess.TimeoutExpired:
        return f"build timeout after {timeout:.0f} s"
    lines = (r.stdout + r.stderr).strip().splitlines()
    return lines[-1] if lines else f"rc={r.returncode}"


def build(ref_dir: str, timeout: float = 600) -> str:
    """Compile the reference's inference extension in a child process; returns its last output line."""
    return _build(f"import sys; sys.path.insert(0, {str(_ref_path(ref_dir))!r}); import twell; "
                  "twell.get_ext(algorithms=['twell_mlp']); print('reference built')", timeout)


def build_train(ref_dir: str, timeout: float = 900) -> str:
    """Compile the reference's training extension (sparse_ops) in a child process; returns its
    last output line. The point processes load it from torch's extension cache."""
    return _build(f"import sys; sys.path.insert(0, {str(_train_path(ref_dir))!r}); import sparse_ops_loader; "
                  "sparse_ops_loader.load_sparse_ops(); print('reference built')", timeout)


def parse_line(stdout: str) -> Optional[dict]:
    """The figures of the child's ``REF {...}`` line (its last), or None where it printed none."""
    rows = [line[4:] for line in stdout.splitlines() if line.startswith("REF ")]
    return json.loads(rows[-1]) if rows else None


def status(rc: int, stderr: str) -> str:
    """``ref_status`` of a child that printed no figures or did not exit 0."""
    sig = f" ({signal.Signals(-rc).name})" if rc < 0 and -rc in signal.valid_signals() else ""
    tail = (stderr.strip().splitlines() or [""])[-1][:120]
    return f"crashed rc={rc}{sig}: {tail}"


def _child(cmd: list[str], timeout: float, out: dict) -> dict:
    """Run one point's child; ``out`` (the NaN figures) updated with its line and ``ref_status``."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env(), cwd=ROOT)
    except subprocess.TimeoutExpired:
        return dict(out, ref_status="timeout")
    row = parse_line(r.stdout)
    if r.returncode != 0 or row is None:
        return dict(out, ref_status=status(r.returncode, r.stderr))
    return dict(out, **row, ref_status="ok")


def _point(m: int, k: int, n: int, d: float, t: float, seed: int) -> list[str]:
    return [str(m), str(k), str(n), repr(d), repr(t), str(seed)]


def run_point(ref_dir: str, m: int, k: int, n: int, d: float, t: float, seed: int,
              reps: int = 100, rounds: int = 5, timeout: float = 150, activity: str = "iid") -> dict:
    """ref_ms, ref_rel_err, ref_nan and ref_status ("ok", "crashed rc=..", "timeout") of one
    point; ``activity``: bench_ffn's --activity spec (testing.make_ffn_for builds the inputs)."""
    _ref_path(ref_dir)
    cmd = [sys.executable, "-m", "benchmarks.reference", ref_dir, *_point(m, k, n, d, t, seed),
           "--reps", str(reps), "--rounds", str(rounds)] + (["--activity", activity] if activity != "iid" else [])
    return _child(cmd, timeout, dict(ref_ms=NAN, ref_rel_err=NAN, ref_nan=None))


def run_train_point(ref_dir: str, m: int, k: int, n: int, d: float, t: float, seed: int,
                    reps: int = 100, timeout: float = 150, activity: str = "iid") -> dict:
    """ref_ms, ref_mib, ref_grad_rel_err (the largest of the four), ref_grad_rel_errs (per
    gradient, GRADS) and ref_status ("ok", "crashed rc=..", "timeout") of one training point."""
    _train_path(ref_dir)
    cmd = [sys.executable, "-m", "benchmarks.reference", "--train", ref_dir, *_point(m, k, n, d, t, seed),
           "--reps", str(reps)] + (["--activity", activity] if activity != "iid" else [])
    return _child(cmd, timeout, dict(ref_ms=NAN, ref_mib=NAN, ref_grad_rel_err=NAN, ref_grad_rel_errs=None))


# The parts of the paper's training step (--train-parts): (part, method, what it covers). Their
# op: ff_forward_gated(X, G, K, V) with G = W_gate, K = W_up, V = W_down^T, state P (relu of the
# gate, hybrid ELL + dense tail), R (up at P's pattern), T (P * R); ff_backward_gated from it.
PAPER_PARTS = (
    ("fwd", "do_bench", "ff_forward_gated under no_grad: gate GEMM with the packing epilogue, overflow tail, "
                        "up at the pattern, relu*up, ELL spmm down (+ the tail's cuBLAS GEMM)"),
    ("bwd", "events", "ff_backward_gated through autograd after a fresh forward (CUDA events around the backward "
                      "only): transposes, dT, dR/dU, dx spmm x2, weight-gradient spmm x3"),
    ("bwd_derived", "derived", "step - fwd (do_bench medians)"),
    ("step", "do_bench", "forward + backward through autograd (torch.autograd.grad of y, dy), as bench_ffn_train.py"),
)
# Device-time parts of one step (torch.profiler, classify_paper's labels), in table order.
PAPER_KERNEL_PARTS = (
    ("fwd.gate_pack", "wgmma gate GEMM with the TwELL-packing epilogue, packed -> ELL conversion, overflow tail"),
    ("fwd.up_down", "up at the pattern (dense_ab_as_sparse), relu*up (sparse_elementwise), ELL spmm down, "
                    "tail GEMM + scatter"),
    ("fwd.fill_copy", "the forward's fills, memsets and copies (zeroed outputs and state)"),
    ("bwd.dh", "dT = dy V^T at the pattern, the L1 shift, dR = dT*P, dU = dT*R (before the first spmm)"),
    ("bwd.transpose", "the three hybrid transposes (T, dR, dU) the weight gradients read"),
    ("bwd.dx", "dx = dR K + dU G: two ELL spmm (+ tail GEMMs, scatters) and their sum"),
    ("bwd.wgrad_up", "dW_up = dR^T X: ELL spmm over the transpose (+ tail)"),
    ("bwd.wgrad_gate", "dW_gate = dU^T X: ELL spmm over the transpose (+ tail)"),
    ("bwd.wgrad_down", "dW_down = T^T dy: ELL spmm over the transpose (+ tail)"),
    ("bwd.fill_copy", "the backward's fills, memsets and copies (zeroed gradients, tail maps)"),
    ("bwd.unattributed", "launches past the fifth ELL spmm of the backward (none expected)"),
    ("kernels", "every launch of the step, summed"),
)
_WGRAD = ("bwd.dx", "bwd.dx", "bwd.wgrad_up", "bwd.wgrad_gate", "bwd.wgrad_down")


def fill_or_copy(name: str) -> bool:
    """A fill, memset or memcpy (torch's zeros, cudaMemsetAsync, cudaMemcpyAsync)."""
    low = name.lower()
    return "fill" in low or "memset" in low or "memcpy" in low


def classify_paper(phase: int, names: list[str]) -> list[str]:
    """Labels (PAPER_KERNEL_PARTS) of the launches of one phase of the paper's step: phase 0 the
    forward, 1 the backward (in launch order). Forward: everything before the first up-at-the-
    pattern kernel (dense_ab_as_sparse...) is the gate + packing, the rest up + down. Backward
    (ff_backward_cuda_gated's order): the transposes by name; before the first ELL spmm, dh;
    from the 1st and 2nd spmm (with their tails and the dX sum), dx; the 3rd, 4th and 5th are
    dW_up, dW_gate, dW_down. Fills, memsets and copies by name in either."""
    out = []
    if phase == 0:
        up = False
        for name in names:
            up = up or "dense_ab_as_sparse" in name
            out.append("fwd.fill_copy" if fill_or_copy(name) else "fwd.up_down" if up else "fwd.gate_pack")
        return out
    spmm = 0
    for name in names:
        if "ell_spmm" in name:
            spmm += 1
        if fill_or_copy(name):
            out.append("bwd.fill_copy")
        elif "transpose_hybrid" in name or "promote_overflow" in name:
            out.append("bwd.transpose")
        elif spmm == 0:
            out.append("bwd.dh")
        else:
            out.append(_WGRAD[spmm - 1] if spmm <= len(_WGRAD) else "bwd.unattributed")
    return out


def run_train_parts_point(ref_dir: str, m: int, k: int, n: int, d: float, t: float, seed: int,
                          reps: int = 300, rounds: int = 3, timeout: float = 240, kernels: bool = True,
                          activity: str = "iid") -> dict:
    """The paper's training step part by part on one point, in a child process: {"parts": [...],
    "ref_status": ...}; a child that dies or times out gives no parts and its status."""
    _train_path(ref_dir)
    cmd = [sys.executable, "-m", "benchmarks.reference", "--train-parts", ref_dir, *_point(m, k, n, d, t, seed),
           "--reps", str(reps), "--rounds", str(rounds)] + ([] if kernels else ["--no-kernels"]) \
        + (["--activity", activity] if activity != "iid" else [])
    return _child(cmd, timeout, dict(parts=[]))


def _paper_train_inputs(a):
    """In a child: the paper's training ops loaded and the point's inputs in their layout (x
    [1, M, K], all three weights [N, K], W_down transposed): (x, wg, wu, wd, dy, leaves, dy3)."""
    sys.path.insert(0, str(_train_path(a.dir)))
    import torch

    import sparse_ops_loader  # the paper's training kernels (sparser-faster-llms), not ours

    from benchmarks.timing import train_inputs

    torch.backends.cuda.matmul.allow_tf32 = False
    sparse_ops_loader.load_sparse_ops()
    m, k = a.M, a.K
    x, wg, wu, wd, dy = train_inputs(m, k, a.N, a.density, a.tail, a.seed, torch.device(a.device), torch.bfloat16,
                                     a.activity)
    leaves = (x.detach().view(1, m, k).requires_grad_(), wg.detach().requires_grad_(),
              wu.detach().requires_grad_(), wd.detach().t().contiguous().requires_grad_())
    return x, wg, wu, wd, dy, leaves, dy.view(1, m, k)


def _train_parts(a) -> None:
    import torch

    from benchmarks.timing import after_ms, bench, interleaved_ms, kernel_parts, kernel_phases, mark_phase

    x, wg, wu, wd, dy, leaves, dy3 = _paper_train_inputs(a)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    op = torch.ops.sparse_ops.ff_forward_gated

    def fwd():
        with torch.no_grad():
            return op(*leaves)

    def step():
        return torch.autograd.grad(op(*leaves)[0], leaves, dy3)

    def bwd(y):
        return torch.autograd.grad(y, leaves, dy3)

    for _ in range(3):
        step()
    if cuda:
        torch.cuda.synchronize()
    if cuda:
        t = interleaved_ms({"fwd": fwd, "step": step}, a.reps, a.rounds,
                           timers={"bwd": lambda rep: after_ms(lambda: op(*leaves)[0], bwd, rep)})
    else:                      # the tests' stand-in reference: the host's wall clock
        t = dict(fwd=bench(fwd, a.reps, False), step=bench(step, a.reps, False),
                 bwd=after_ms(lambda: op(*leaves)[0], bwd, a.reps, cuda=False))
    t["bwd_derived"] = t["step"] - t["fwd"]
    parts = [dict(part=p, ms=t[p], method=meth, launches=what) for p, meth, what in PAPER_PARTS]
    if cuda and a.kernels:
        def marked():
            mark_phase()
            y = op(*leaves)[0]
            mark_phase()
            bwd(y)

        marked()
        got = kernel_parts(kernel_phases(marked, a.kernel_steps), 2, classify_paper)
        got["kernels"] = sum(got.values())
        parts += [dict(part=p, ms=got.get(p, 0.0), method="kernels", launches=what) for p, what in PAPER_KERNEL_PARTS]
    print("REF " + json.dumps(dict(parts=parts)), flush=True)


def _infer(a) -> None:
    sys.path.insert(0, str(_ref_path(a.dir)))
    import torch
    import torch.nn.functional as F

    import twell as reference  # the paper's module (sparser-faster-llms), not ours

    from benchmarks.timing import interleaved_ms, rel
    from twell_compile.testing import make_ffn_for

    torch.set_grad_enabled(False)
    torch.backends.cuda.matmul.allow_tf32 = False
    p = make_ffn_for(a.activity, a.M, a.K, a.N, a.density, a.tail, device="cuda", seed=a.seed)
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    mod = reference.TwELLGatedMLP(0, GATE=wg, UP=wu, DOWN=wd.t().contiguous())
    for _ in range(3):
        mod(x)
    torch.cuda.synchronize()
    ms = interleaved_ms({"ref": lambda: mod(x)}, a.reps, a.rounds)["ref"]
    r = min(a.M, 8192)               # bench_ffn.py's ERR_ROWS
    y = mod(x)
    ref32 = F.linear(F.relu(F.linear(x[:r].float(), wg.float())) * F.linear(x[:r].float(), wu.float()), wd.float())
    err = rel(y[:r], ref32)
    print("REF " + json.dumps(dict(ref_ms=ms, ref_rel_err=err if math.isfinite(err) else NAN,
                                   ref_nan=bool(torch.isnan(y).any()))), flush=True)


def _train(a) -> None:
    import torch

    from benchmarks.timing import bench, peak_mib, rel
    from twell_compile.reference import ffn_dense

    x, wg, wu, wd, dy, leaves, dy3 = _paper_train_inputs(a)
    m, k = a.M, a.K
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"

    def step():
        return torch.autograd.grad(torch.ops.sparse_ops.ff_forward_gated(*leaves)[0], leaves, dy3)

    for _ in range(3):
        step()
    if cuda:
        torch.cuda.synchronize()
    ms = bench(step, a.reps, cuda)                 # as bench_ffn_train.py times ours
    mib = peak_mib(step, cuda)
    gx, gg, gu, gd = step()
    got = (gx.reshape(m, k), gg, gu, gd.t())
    # bench_ffn_train.py's error: fp32 autograd through the bf16 leaves
    ref = torch.autograd.grad(ffn_dense(x.float(), wg.float(), None, wu.float(), None, wd.float(), None),
                              (x, wg, wu, wd), dy.float())
    errs = {name: rel(g, r) for name, g, r in zip(GRADS, got, ref)}
    worst = NAN if any(not math.isfinite(e) for e in errs.values()) else max(errs.values())
    print("REF " + json.dumps(dict(ref_ms=ms, ref_mib=mib, ref_grad_rel_err=worst, ref_grad_rel_errs=errs)),
          flush=True)


def _main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", action="store_true", help="the training op, forward + backward")
    ap.add_argument("--train-parts", action="store_true", help="the training op part by part (train_parts.py)")
    ap.add_argument("--no-kernels", dest="kernels", action="store_false",
                    help="--train-parts: no torch.profiler breakdown")
    ap.add_argument("--kernel-steps", type=int, default=5, help="--train-parts: steps profiled")
    ap.add_argument("dir")
    ap.add_argument("M", type=int)
    ap.add_argument("K", type=int)
    ap.add_argument("N", type=int)
    ap.add_argument("density", type=float)
    ap.add_argument("tail", type=float)
    ap.add_argument("seed", type=int)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (inference)")
    ap.add_argument("--device", default="cuda", help="--train / --train-parts' device (cpu: the tests' stand-in reference)")
    ap.add_argument("--activity", default="iid", help="the inputs' activity spec (bench_ffn / bench_ffn_train --activity)")
    a = ap.parse_args(argv)
    (_train_parts if a.train_parts else _train if a.train else _infer)(a)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
