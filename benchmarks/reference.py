"""The paper's inference kernels (TwELLGatedMLP of SakanaAI/sparser-faster-llms) on one point,
in a process of their own: the reference gives wrong output on long tails and crashes on some
points, and a crash must not take the benchmark with it. Never vendored: DIR is the
``sparser-faster-llms`` folder carried to the GPU machine (../shared/anchor/README.md).

    python3 -m benchmarks.reference DIR M K N DENSITY TAIL SEED [--reps MS] [--rounds R]

prints one line ``REF {"ref_ms": ..., "ref_rel_err": ..., "ref_nan": ...}`` for the inputs
twell_compile.testing.make_ffn(M, K, N, DENSITY, TAIL, seed=SEED) builds (the same bits as the
calling benchmark's: the generator is seeded per point). bench_ffn.py --reference DIR calls
``run_point`` per point; ``build`` compiles the reference's extension once, up front (about
90 s with 12 jobs).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAN = float("nan")


def _ref_path(ref_dir: str) -> Path:
    path = Path(ref_dir) / "custom_models" / "twell_modules"
    if not (path / "twell.py").is_file():
        raise ValueError(f"--reference {ref_dir!r}: no custom_models/twell_modules/twell.py there; pass the "
                         "sparser-faster-llms folder (../shared/anchor/README.md shows how to carry it)")
    return path


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def build(ref_dir: str, timeout: float = 600) -> str:
    """Compile the reference's inference extension in a child process; returns its last output line."""
    code = (f"import sys; sys.path.insert(0, {str(_ref_path(ref_dir))!r}); import twell; "
            "twell.get_ext(algorithms=['twell_mlp']); print('reference built')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=_env())
    lines = (r.stdout + r.stderr).strip().splitlines()
    return lines[-1] if lines else f"rc={r.returncode}"


def run_point(ref_dir: str, m: int, k: int, n: int, d: float, t: float, seed: int,
              reps: int = 100, rounds: int = 5, timeout: float = 150) -> dict:
    """ref_ms, ref_rel_err, ref_nan and ref_status ("ok", "crashed rc=..", "timeout") of one point."""
    _ref_path(ref_dir)
    cmd = [sys.executable, "-m", "benchmarks.reference", ref_dir, str(m), str(k), str(n), repr(d), repr(t),
           str(seed), "--reps", str(reps), "--rounds", str(rounds)]
    out = dict(ref_ms=NAN, ref_rel_err=NAN, ref_nan=None)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    except subprocess.TimeoutExpired:
        return dict(out, ref_status="timeout")
    row = next((line[4:] for line in r.stdout.splitlines() if line.startswith("REF ")), None)
    if r.returncode != 0 or row is None:
        tail = (r.stderr.strip().splitlines() or [""])[-1][:120]
        return dict(out, ref_status=f"crashed rc={r.returncode}: {tail}")
    return dict(out, **json.loads(row), ref_status="ok")


def _main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("M", type=int)
    ap.add_argument("K", type=int)
    ap.add_argument("N", type=int)
    ap.add_argument("density", type=float)
    ap.add_argument("tail", type=float)
    ap.add_argument("seed", type=int)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(_ref_path(a.dir)))
    import torch
    import torch.nn.functional as F

    import twell as reference  # the paper's module (sparser-faster-llms), not ours

    from benchmarks.timing import interleaved_ms, rel
    from twell_compile.testing import make_ffn

    torch.set_grad_enabled(False)
    torch.backends.cuda.matmul.allow_tf32 = False
    p = make_ffn(a.M, a.K, a.N, a.density, a.tail, device="cuda", seed=a.seed)
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
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
