"""Helpers shared by the test suite: error measures, the 2x-eager tolerance rule, poisoned
allocations, and the synthetic inputs' argument order.

Kernel numerics follow one rule: error against a higher-precision reference at most 2x plain
PyTorch's error in the same dtype (``check_close``). Outputs are checked after ``poison()``
fills recently freed device memory with NaN, so a kernel that leaves an output unwritten fails.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ARG_NAMES = ("x", "w_gate", "b_gate", "w_up", "b_up", "w_down", "b_down")
# torch.compile options that rewrite every matched FFN, whatever the speed rules say (tiny CPU
# models and CPU training are otherwise left to Inductor: tests/runtime/test_select.py)
REWRITE_ALL = {"twell.skip_dense": False}


def ffn_with_biases(m: int, k: int, n: int, k_out: int, density: float, tail: float = 0.0, *,
                    dtype: torch.dtype = torch.bfloat16, gated: bool = True, bias: bool = True,
                    seed: int | None = None, down_floor: float = 1e-3) -> dict:
    """A CUDA FFN for the GPU kernel tests: ``twell_compile.testing.make_ffn``'s inputs (fresh
    seed unless given) with K_out != K allowed (W_down scaled by 1/sqrt(N max(density,
    down_floor))), random biases, and at density 0 a gate that never fires. The seed is printed:
    pytest shows it under a failed test's captured output, so a fresh draw that fails can be
    replayed (``seed=``)."""
    from twell_compile.testing import make_ffn

    seed = torch.randint(0, 2**31, ()).item() if seed is None else seed
    print(f"ffn_with_biases(m={m}, k={k}, n={n}, k_out={k_out}, density={density}, tail={tail}, seed={seed})")
    p = make_ffn(m, k, n, max(density, 1e-9), tail, gated=gated, dtype=torch.float32, seed=seed)
    g = torch.Generator("cuda").manual_seed(seed + 1)
    p["w_down"] = torch.randn(k_out, n, generator=g, device="cuda") / (n * max(density, down_floor)) ** 0.5
    if density == 0.0:
        p["w_gate"][:, 0] = -1e4            # no gate ever fires
    if bias:
        p["b_gate"] = torch.randn(n, generator=g, device="cuda") * 0.1
        p["b_up"] = torch.randn(n, generator=g, device="cuda") if gated else None
        p["b_down"] = torch.randn(k_out, generator=g, device="cuda")
    return {key: None if v is None else v.to(dtype) for key, v in p.items()}


def twell_op_calls(fn):
    """(the twell ops ``fn()`` called, by name in call order; what ``fn`` returned), from the
    profiler's record of dispatched ops."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return [e.name for e in prof.events() if e.name.startswith("twell::")], out


def last_paths(training: bool = False) -> dict[str, set[str]]:
    """{layer: the paths its last calls took, over op instances, devices and shapes}, from the
    runtime's public record of each layer's state (``density.snapshot``): inference keys start
    with the layer, training keys with ("train", layer). CUDA plans only (CPU calls keep no
    state)."""
    from twell_compile.runtime import density

    out: dict[str, set[str]] = {}
    for _instance, key, _density, path in density.snapshot():
        if training and key[0] == "train":
            out.setdefault(key[1], set()).add(path)
        elif not training and key[0] not in ("train", "train-lost") and path:
            out.setdefault(key[0], set()).add(path)
    return out


def ffn_args(p: dict) -> tuple:
    """The op's seven tensor arguments from ``twell_compile.testing.make_ffn``'s dict."""
    return tuple(p[name] for name in ARG_NAMES)


def rel(a: torch.Tensor, b: torch.Tensor, finite_only: bool = False) -> float:
    """||a - b|| / ||b|| in fp64 (over b's finite entries with ``finite_only``)."""
    a, b = a.double(), b.double()
    if finite_only:
        fin = torch.isfinite(b)
        a, b = a[fin], b[fin]
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def poison(mib: int = 256, device: str = "cuda") -> None:
    """Fill recently freed allocator blocks with NaN so unwritten outputs show."""
    junk = torch.full((mib << 18,), float("nan"), device=device)
    del junk


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def check_close(name: str, got: torch.Tensor, eager: torch.Tensor, ref64: torch.Tensor | None = None) -> None:
    """fp32/fp64: tight against eager. bf16/fp16: error vs fp64 at most 2x eager's own error.

    The low-precision rule allows one extra ulp at the output's scale on top: on a handful of
    elements eager can round to the exact fp64 value by luck (error 0), which no other correct
    summation order is obliged to repeat. One ulp, not half: an output computed from a rounded
    intermediate carries both roundings. Seen with a 1 x 1 x 2 FFN in bf16 (hypothesis, seed
    186): grad down.weight = dy * h, with h from a fused F.linear(x, w, b) (one rounding) where
    eager's x @ w.t() + b rounds twice and landed nearer fp64 by luck: ours 2.3e-4 off at
    0.0495 (1 ulp = 3.9e-4), eager's 1.3e-5.
    """
    assert got.shape == eager.shape, f"{name}: shape {tuple(got.shape)} != eager {tuple(eager.shape)}"
    assert got.dtype == eager.dtype, f"{name}: dtype {got.dtype} != eager {eager.dtype}"
    if got.dtype in (torch.float32, torch.float64) or ref64 is None:
        scale = max(eager.double().abs().max().item() if eager.numel() else 0.0, 1.0)
        tol = (1e-5 if got.dtype == torch.float32 else 1e-12) * scale
        err = max_err(got, eager)
        assert err <= tol, f"{name}: max error {err:.3g} vs eager > {tol:.3g}"
        return
    err, eager_err = max_err(got, ref64), max_err(eager, ref64)
    floor = torch.finfo(got.dtype).eps * (ref64.abs().max().item() if ref64.numel() else 0.0)
    assert err <= 2 * eager_err + floor, (
        f"{name}: error vs fp64 {err:.3g} > 2 x eager {got.dtype} error {eager_err:.3g}")


def run_interpreted(script: str, timeout: int = 120) -> None:
    """Run ``script`` in a fresh Python under TRITON_INTERPRET=1 (the interpreter is chosen when
    the kernels are defined, so each case gets its own process); it must print a line starting
    with "ok". Skips where Triton < 3.7's interpreter cannot run the kernels (the device image's
    Triton 3.6 fails inside numpy: "only 0-dimensional arrays can be converted")."""
    triton = pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    old = tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7)
    if r.returncode != 0 and old and "InterpreterError" in r.stderr:
        pytest.skip(f"Triton {triton.__version__} interpreter cannot run the kernels: {r.stderr[-200:]}")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert r.stdout.startswith("ok"), r.stdout


def check_non_finite_contract(y: torch.Tensor, args: tuple) -> None:
    """y against the non-finite contract every inference path keeps (docs/cpu.md "NaN and Inf"):
    rows of x holding NaN/Inf give eager's NaN/Inf pattern; where eager's output is finite, so
    is y; where eager's is non-finite only through an inactive neuron (0 * Inf at a NaN/Inf
    weight or an overflowing up projection), y is NaN (eager's) or the sum over active neurons
    (``ffn_active_only``). Values are compared elsewhere (the 2x rule)."""
    from twell_compile.reference import ffn_active_only, ffn_dense

    x = args[0]
    eager, sparse = ffn_dense(*args), ffn_active_only(*args)
    bad_x = ~torch.isfinite(x).all(-1, keepdim=True).expand_as(eager)

    def kind(t):          # 0 finite, 1 NaN, 2 +Inf, 3 -Inf
        return torch.where(torch.isnan(t), 1, torch.where(t == float("inf"), 2, torch.where(t == float("-inf"), 3, 0)))

    ky, ke, ks = kind(y), kind(eager), kind(sparse)
    assert torch.equal(ky[bad_x], ke[bad_x]), "rows of x with NaN/Inf: eager's pattern"
    assert (ky[~bad_x & (ke == 0)] == 0).all(), "finite where eager is finite"
    rest = ~bad_x & (ke != 0)
    assert ((ky[rest] == ke[rest]) | (ky[rest] == ks[rest])).all(), "eager's or the active-only sum's"


def load_example(name: str):
    """examples/<name>.py imported as module ``name`` (the examples are scripts, not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
