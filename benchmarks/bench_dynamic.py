"""Compiled FFN under dynamic token counts: backend="twell" vs "inductor", training or inference.

    python3 benchmarks/bench_dynamic.py                 # training step, M = 1024 4096 16384 2048
    python3 benchmarks/bench_dynamic.py --inference     # forward, M = 1024 16384 16 4096
    python3 benchmarks/bench_dynamic.py --quick         # CPU smoke test, tiny shapes (both modes)

One gated ReLU FFN module (nn.Linear, bf16, no biases; weights and inputs from
twell_compile/testing.py, d=0.005) compiled once per backend with ``dynamic=True``, then run at
each M in the order given: a training step (y = ffn(x); torch.autograd.grad of x and the three
weights) or, with --inference, a forward under no_grad. This is what a model sees when its
batch changes: the twell backend answers its token-count rules under guards
(select.static_reason: training under the record's train_min_tokens; inference in the band
between the decode path and the per-row path), so counts there run Inductor's FFN and a count
in another range recompiles once. Per M: wall us per call (back-to-back calls, synchronised at
the end; best of ``--rounds`` rounds, alternating between the backends: at small M the call is
host-bound and do_bench's events would hide that), the compiles so far per backend, whether
twell's call ran our op, and the error (max over the gradients, or the output's) against fp32
next to Inductor's. Rows as benchmarks/rows.py stamps them; written to --out (default
runs/<gpu>/dynamic_train.json or dynamic_inference.json; the canonical files:
benchmarks/results/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):                  # run as a file: python3 benchmarks/bench_dynamic.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.rows import out_path, stamp, write_json  # noqa: E402
from benchmarks.timing import gpu_name, rel  # noqa: E402
from twell_compile.testing import GatedMLP, make_ffn  # noqa: E402


class Counting:
    """A backend wrapper counting compiles."""

    def __init__(self, name: str):
        self.name, self.calls = name, 0

    def __call__(self, gm, example_inputs, **kw):
        if self.name == "twell":
            from twell_compile.backend import twell_backend
            compiled = twell_backend(gm, example_inputs, **kw)
        else:
            from torch._inductor.compile_fx import compile_fx
            compiled = compile_fx(gm, example_inputs)
        self.calls += 1
        return compiled


class OpCalls:
    """Counts calls of our ops' implementations (runtime/execute.py's ffn_train_forward and
    ffn_infer, looked up by the ops at each call), so a step can tell which graph ran: ours or
    Inductor's FFN. With ``cpu_rule`` (--quick), the compile-time rules answer CPU facts as for a
    bf16 CUDA FFN (select.compile_rules_for) at small thresholds (arch.patched: decode <= 8,
    per-row and training >= 32, K >= 16 for both). Everything is put back on exit."""

    CPU_RULE = dict(decode_max_m=8, min_tokens=32, train_min_tokens=32, min_width=16, train_min_width=16)

    def __init__(self, cpu_rule: bool):
        self.n, self.cpu_rule = 0, cpu_rule
        self._patches = contextlib.ExitStack()

    def __enter__(self):
        from twell_compile.runtime import arch, execute, select
        self._saved = (execute.ffn_train_forward, execute.ffn_infer)
        fwd, infer = self._saved

        def counting(fn):
            def counted(*args, **kwargs):
                self.n += 1
                return fn(*args, **kwargs)
            return counted
        execute.ffn_train_forward, execute.ffn_infer = counting(fwd), counting(infer)
        if self.cpu_rule:
            self._patches.enter_context(arch.patched(**self.CPU_RULE))
            self._patches.enter_context(select.compile_rules_for("cuda", torch.bfloat16))
        return self

    def __exit__(self, *exc):
        from twell_compile.runtime import execute
        execute.ffn_train_forward, execute.ffn_infer = self._saved
        self._patches.close()
        return False


def wall_us(fn, steps: int, rounds: int, cuda: bool) -> float:
    best = float("inf")
    for _ in range(rounds):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / steps * 1e6)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, nargs="+", default=None, help="token counts, stepped in this order")
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--K", type=int, default=None, help="default 2048 (--quick: 32)")
    ap.add_argument("--N", type=int, default=None, help="default 5632 (--quick: 80)")
    ap.add_argument("--steps", type=int, default=None, help="steps per timing round, default 50 (--quick: 2)")
    ap.add_argument("--rounds", type=int, default=None, help="default 5 (--quick: 1)")
    ap.add_argument("--inference", action="store_true", help="forward under no_grad instead of a training step")
    ap.add_argument("--quick", action="store_true", help="CPU smoke test on tiny shapes")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    def given(v, quick, full):
        return v if v is not None else (quick if a.quick else full)
    ms = given(a.M, [16, 48, 4, 24] if a.inference else [16, 48, 8],
               [1024, 16384, 16, 4096] if a.inference else [1024, 4096, 16384, 2048])
    k, n = given(a.K, 32, 2048), given(a.N, 80, 5632)
    steps, rounds = given(a.steps, 2, 50), given(a.rounds, 1, 5)
    for flag, v in (("--K", k), ("--N", n), ("--steps", steps), ("--rounds", rounds), *(("--M", m) for m in ms)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if not 0.0 < a.density <= 1.0:
        raise ValueError(f"--density must be in (0, 1], got {a.density}")
    cuda = not a.quick
    dev = torch.device("cuda" if cuda else "cpu")
    dt = torch.bfloat16 if cuda else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = False
    with OpCalls(cpu_rule=a.quick) as op_calls:
        rows = run(ms, k, n, a.density, steps, rounds, dev, dt, op_calls, not a.inference)
    name = "dynamic_train.json" if not a.inference else "dynamic_inference.json"
    out = out_path(a.out, gpu_name() if cuda else "cpu", name)
    write_json(out, rows)
    print(f"wrote {out} ({len(rows)} rows)")
    return 0


def run(ms, k, n, density, steps, rounds, dev, dt, op_calls, train: bool) -> list[dict]:
    cuda = dev.type == "cuda"
    p0 = make_ffn(max(ms), k, n, density, 0.0, device=dev, seed=1, dtype=dt)
    mods, compiled, backends = {}, {}, {}
    for name in ("twell", "inductor"):
        mod = GatedMLP(k, n).to(dev, dt)
        with torch.no_grad():
            mod.gate.weight.copy_(p0["w_gate"])
            mod.up.weight.copy_(p0["w_up"])
            mod.down.weight.copy_(p0["w_down"])
        backends[name] = Counting(name)
        mods[name] = mod
        compiled[name] = torch.compile(mod, backend=backends[name], dynamic=True)
    rows = []
    print(f"{'M':>6} {'twell_us':>9} {'ind_us':>9} {'ratio':>6} {'op':>3} {'tw_cmp':>6} {'ind_cmp':>7} "
          f"{'err':>8} {'ind_err':>8}", flush=True)
    for m in ms:
        x0 = p0["x"][:m].detach()
        dy = torch.randn(m, k, device=dev, dtype=torch.float32,
                         generator=torch.Generator(dev).manual_seed(m)).to(dt)
        x = x0.clone().requires_grad_(train)
        steppers, got = {}, {}
        for name in ("twell", "inductor"):
            params = (x, *mods[name].parameters())

            def step(f=compiled[name], params=params):
                if not train:
                    with torch.no_grad():
                        return (f(x),)
                return torch.autograd.grad(f(x), params, dy)
            before = op_calls.n
            got[name] = step()                           # compiles here if it must
            if name == "twell":
                ran_op = op_calls.n > before
            for _ in range(3):
                step()
            steppers[name] = step
        # rounds alternate between the backends: timed one after the other, identical
        # Inductor graphs read 0.92-0.94x at 1024-2048 tokens (H200, 2026-11-23)
        us = {name: float("inf") for name in steppers}
        for _ in range(rounds):
            for name, step in steppers.items():
                us[name] = min(us[name], wall_us(step, steps, 1, cuda))
        res = {name: (us[name], got[name]) for name in steppers}
        ref_mod = GatedMLP(k, n).to(dev, torch.float32)
        ref_mod.load_state_dict({kk: v.float() for kk, v in mods["twell"].state_dict().items()})
        x64 = x0.float().requires_grad_(train)
        if train:
            ref = torch.autograd.grad(ref_mod(x64), (x64, *ref_mod.parameters()), dy.float())
        else:
            with torch.no_grad():
                ref = (ref_mod(x64),)
        err = max(rel(g, r) for g, r in zip(res["twell"][1], ref))
        ierr = max(rel(g, r) for g, r in zip(res["inductor"][1], ref))
        tw, ind = res["twell"][0], res["inductor"][0]
        row = stamp(dict(
            M=m, K=k, N=n, density=density, mode="train" if train else "inference", twell_us=tw, inductor_us=ind,
            twell_op_ran=ran_op, twell_compiles=backends["twell"].calls, inductor_compiles=backends["inductor"].calls,
            rel_err=err, inductor_rel_err=ierr), dev)
        rows.append(row)
        print(f"{m:>6} {tw:>9.1f} {ind:>9.1f} {ind / tw:>6.2f} {'yes' if ran_op else 'no':>3} "
              f"{row['twell_compiles']:>6} {row['inductor_compiles']:>7} {err:>8.1e} {ierr:>8.1e}"
              + ("  ERR>2x" if err > 2 * ierr else ""), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
