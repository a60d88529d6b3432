"""The FFN rewrite: the graph handed on holds one twell op per FFN and none of the replaced
nodes, and outputs and gradients (x and every parameter) match eager.

Most examples run the rewritten graph eagerly (``PassBackend``: fast); a handful go through the
real ``backend="twell"`` with Inductor, inspecting the graph the backend hands to compile_fx.
Tolerances: fp32/fp64 tight against eager; bf16 error vs fp64 at most 2x eager bf16's own.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from torch.utils.checkpoint import checkpoint

import twell_compile
from twell_compile.config import TwellConfig

from tests.helpers import REWRITE_ALL
from tests.passes.ffn_zoo import Spec, build, eager_allows, specs
from tests.passes.rewrite_harness import REPLACED_FNS, REPLACED_METHODS, TWELL_OPS, PassBackend, check_close
from twell_compile.testing import GatedMLP, PlusMean

DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def _expected_op(grad: bool, params_grad: bool, x_grad: bool) -> str:
    return "twell::ffn_train" if grad and (params_grad or x_grad) else "twell::ffn"


def _compare(spec: Spec, dtype: torch.dtype, seed: int, model: nn.Module, compiled: Any, grad: bool,
             params_grad: bool, x_grad: bool) -> None:
    """Run compiled and eager on one fresh input; compare outputs and all gradients."""
    torch.manual_seed(seed + 1)
    x = torch.randn(*spec.batch, spec.k, dtype=dtype)
    xs = [x.clone().requires_grad_(x_grad) for _ in range(2)]
    with torch.set_grad_enabled(grad):
        got = compiled(xs[0])
        want = model(xs[1])
    ref = build(spec, torch.float64, seed)
    x64 = x.double().requires_grad_(x_grad)
    with torch.set_grad_enabled(grad and (params_grad or x_grad)):
        y64 = ref(x64)
    check_close("output", got, want, y64)
    if not (grad and (params_grad or x_grad)):
        assert not got.requires_grad
        return
    dy = torch.randn_like(want)   # fresh random upstream gradient, never ones/zeros
    leaves = ([x64] if x_grad else []) + (list(ref.parameters()) if params_grad else [])
    want_leaves = ([xs[1]] if x_grad else []) + (list(model.parameters()) if params_grad else [])
    got_leaves = ([xs[0]] if x_grad else []) + (list(model.parameters()) if params_grad else [])
    g_got = torch.autograd.grad(got, got_leaves, dy)
    g_want = torch.autograd.grad(want, want_leaves, dy)
    g_ref = torch.autograd.grad(y64, leaves, dy.double())
    names = (["x"] if x_grad else []) + ([n for n, _ in model.named_parameters()] if params_grad else [])
    for name, a, b, c in zip(names, g_got, g_want, g_ref, strict=True):
        check_close(f"grad {name}", a, b, c)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=specs(), dtype=st.sampled_from(DTYPES), grad=st.booleans(), params_grad=st.booleans(),
       x_grad=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_rewrite_matches_eager(spec: Spec, dtype: torch.dtype, grad: bool, params_grad: bool,
                               x_grad: bool, seed: int) -> None:
    assume(eager_allows(spec, grad and (params_grad or x_grad)))
    torch._dynamo.reset()
    model = build(spec, dtype, seed).requires_grad_(params_grad)
    backend = PassBackend()
    compiled = torch.compile(model, backend=backend)
    _compare(spec, dtype, seed, model, compiled, grad, params_grad, x_grad)
    assert backend.twell_ops() == [_expected_op(grad, params_grad, x_grad)], spec.describe()
    assert not backend.leftovers(), f"{spec.describe()}: {backend.leftovers()}"
    assert len(backend.report.rewrites) == 1 and not backend.report.rejections


# ------------------------------------------------------------------------------ through Inductor
class CompileFxSpy:
    """Wraps Inductor's compile_fx to keep the graphs the twell backend hands to it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        import torch._inductor.compile_fx as cfx

        self.graphs: list[torch.fx.GraphModule] = []
        original = cfx.compile_fx

        def spy(gm, example_inputs, *args, **kwargs):
            self.graphs.append(gm)
            return original(gm, example_inputs, *args, **kwargs)

        monkeypatch.setattr(cfx, "compile_fx", spy)

    def node_kinds(self) -> tuple[list[str], list[str]]:
        ops, replaced = [], []
        for gm in self.graphs:
            for sub in gm.modules():
                if not isinstance(sub, torch.fx.GraphModule):
                    continue
                for n in sub.graph.nodes:
                    if n.op == "call_function" and str(n.target) in TWELL_OPS:
                        ops.append(TWELL_OPS[str(n.target)])
                    elif (n.op == "call_function" and n.target in REPLACED_FNS) or (
                            n.op == "call_method" and n.target in REPLACED_METHODS):
                        replaced.append(str(n.target))
        return ops, replaced


INDUCTOR_CASES = [
    (Spec(linear="nn.Linear", bias=False, split=None, k=16, n=40, k_out=16, batch=(2, 7)), torch.float32, True),
    (Spec(linear="F.linear", bias=True, relu="relu_", split="chunk", k=13, n=29, k_out=11, batch=(9,)),
     torch.float32, False),
    (Spec(linear="addmm", bias=True, gated=False, relu="nn.ReLU", k=12, n=31, k_out=12, batch=(3, 5)),
     torch.float32, True),
    (Spec(linear="x@w.T", bias=True, mul="torch.mul", relu_first=False, split="slice", dropout="eval",
          k=16, n=24, k_out=8, batch=(2, 5)), torch.bfloat16, True),
]


@pytest.mark.parametrize("spec, dtype, grad", INDUCTOR_CASES, ids=lambda v: getattr(v, "linear", str(v)))
def test_twell_backend_end_to_end(spec: Spec, dtype: torch.dtype, grad: bool, monkeypatch) -> None:
    spy = CompileFxSpy(monkeypatch)
    model = build(spec, dtype, seed=3)
    compiled = torch.compile(model, backend="twell", options=REWRITE_ALL)
    _compare(spec, dtype, 3, model, compiled, grad, True, True)
    ops, replaced = spy.node_kinds()
    assert ops == [_expected_op(grad, True, True)], ops
    assert not replaced, replaced


def test_options_turn_rewrites_off(monkeypatch) -> None:
    spec = Spec(k=8, n=12, k_out=8, batch=(4,))
    model = build(spec)
    x = torch.randn(4, 8)
    with torch.no_grad():
        off = twell_compile.explain(model, x, options={**REWRITE_ALL, "twell.enabled": False})
        no_infer = twell_compile.explain(model, x, options={**REWRITE_ALL, "twell.rewrite_inference": False})
    no_train = twell_compile.explain(model, x, options={**REWRITE_ALL, "twell.rewrite_training": False})
    for report, reason in ((off, "enabled is False"), (no_infer, "rewrite_inference"),
                           (no_train, "rewrite_training")):
        assert not report.rewrites and len(report.rejections) == 1, str(report)
        assert reason in report.rejections[0].reason
    backend = PassBackend(TwellConfig(enabled=False))
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
    assert not backend.twell_ops() and torch.equal(got, model(x).detach())


def test_skip_dense_leaves_slow_paths_to_inductor_unless_the_penalty_needs_our_backward() -> None:
    """Where our op would surely run slower than Inductor's code (here: CPU training runs the
    plain-PyTorch path; a tiny CPU inference FFN is under the C++ kernel's minimum work), the
    FFN is left to Inductor with the reason, unless an L1 penalty needs our backward (training)
    or skip_dense is off."""
    spec = Spec(k=8, n=12, k_out=8, batch=(4,))
    model = build(spec)
    x = torch.randn(4, 8)
    skipped = twell_compile.explain(model, x)
    assert not skipped.rewrites and "training on CPU" in skipped.rejections[0].reason
    assert "skip_dense=False" in skipped.rejections[0].reason
    for options in ({"twell.l1": 1e-3}, REWRITE_ALL):
        kept = twell_compile.explain(model, x, options=options)
        assert len(kept.rewrites) == 1 and kept.rewrites[0].op == "twell::ffn_train", (options, str(kept))
        # and it says which path a CPU training FFN runs
        assert kept.rewrites[0].runs.startswith("plain PyTorch") and "runs" in str(kept), str(kept)
    with torch.no_grad():
        small = twell_compile.explain(model, x)
        assert not small.rewrites and "CPU kernel" in small.rejections[0].reason
        assert not twell_compile.explain(model, x, options={"twell.l1": 1e-3}).rewrites   # no penalty at inference
        assert len(twell_compile.explain(model, x, options=REWRITE_ALL).rewrites) == 1


# ------------------------------------------------------------------------------ subgraphs
class CheckpointedBlocks(nn.Module):
    """Two residual blocks whose MLPs run under non-reentrant activation checkpointing."""

    def __init__(self):
        super().__init__()
        self.mlps = nn.ModuleList([GatedMLP(), GatedMLP()])
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        for mlp in self.mlps:
            x = x + checkpoint(mlp, self.norm(x), use_reentrant=False)
        return x


def _grads(y: torch.Tensor, leaves: list[torch.Tensor], dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(y, leaves, dy)


def test_checkpoint_subgraph_is_rewritten() -> None:
    torch.manual_seed(0)
    model = CheckpointedBlocks()
    x = torch.randn(2, 5, 16)
    backend = PassBackend()
    xs = [x.clone().requires_grad_() for _ in range(2)]
    got = torch.compile(model, backend=backend)(xs[0])
    want = model(xs[1])
    # The MLPs live in higher-order-op subgraphs, not in the top-level graph.
    top = [n for n in backend.graphs[0].graph.nodes if n.op == "call_function" and str(n.target) in TWELL_OPS]
    assert not top and backend.twell_ops() == ["twell::ffn_train"] * 2
    assert all(r.graph for r in backend.report.rewrites), str(backend.report)
    assert not backend.leftovers()
    check_close("output", got, want)
    dy = torch.randn_like(want)
    params = list(model.parameters())
    for name, a, b in zip(["x"] + [n for n, _ in model.named_parameters()],
                          _grads(got, [xs[0]] + params, dy), _grads(want, [xs[1]] + params, dy)):
        check_close(f"grad {name}", a, b)


def test_checkpoint_through_inductor(monkeypatch) -> None:
    torch.manual_seed(0)
    spy = CompileFxSpy(monkeypatch)
    model = CheckpointedBlocks()
    x = torch.randn(3, 4, 16)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    got = torch.compile(model, backend="twell", options=REWRITE_ALL)(xs[0])
    want = model(xs[1])
    ops, replaced = spy.node_kinds()
    assert ops == ["twell::ffn_train"] * 2 and not replaced
    check_close("output", got, want)
    dy = torch.randn_like(want)
    params = list(model.parameters())
    for a, b in zip(_grads(got, [xs[0]] + params, dy), _grads(want, [xs[1]] + params, dy)):
        check_close("grad", a, b)


# ------------------------------------------------------------------------------ dtypes
def test_autocast_region_keeps_its_numerics() -> None:
    """Under CPU bf16 autocast the projections produce bf16: the op gets bf16 inputs."""
    torch.manual_seed(0)
    model = GatedMLP()
    x = torch.randn(4, 6, 16)
    backend = PassBackend()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.compile(model, backend=backend)(x)
        want = model(x)
    assert backend.twell_ops() == ["twell::ffn"]
    assert got.dtype == want.dtype == torch.bfloat16
    ref = model.double()(x.double())
    check_close("output", got, want, ref)


class Mixed(nn.Module):
    """A fp32 FFN, optionally under autocast inside forward (around activation checkpointing,
    and with an autocast-disabled region inside)."""

    def __init__(self, where: str = ""):
        super().__init__()
        self.mlp, self.where = GatedMLP(), where

    def forward(self, x):
        if self.where == "checkpoint":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return checkpoint(self.mlp, x, use_reentrant=False)
        if self.where == "disabled":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                with torch.autocast("cpu", enabled=False):
                    return self.mlp(x)
        return self.mlp(x)


@pytest.mark.parametrize("where", ["", "disabled"])
@pytest.mark.parametrize("change", ["x", "down"])
def test_mixed_dtypes_outside_autocast_raise_as_eager(where: str, change: str) -> None:
    """bf16 x into fp32 weights (or one bf16 weight) outside autocast: F.linear raises, and so
    does the compiled model (the FFN is left to Inductor, with the reason in the report),
    instead of casting to make it pass."""
    torch.manual_seed(0)
    model = Mixed(where)
    x = torch.randn(3, 16)
    if change == "x":
        x = x.bfloat16()
    else:
        model.mlp.down.bfloat16()
    backend = PassBackend()
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="same dtype"):
            model(x)
        with pytest.raises(RuntimeError, match="same dtype"):
            torch.compile(model, backend=backend)(x)
        report = backend.report
        assert not report.rewrites and "mixes dtypes" in report.rejections[0].reason, str(report)
        assert "outside autocast" in report.rejections[0].reason
        torch._dynamo.reset()
        with pytest.raises(RuntimeError, match="same dtype"):
            torch.compile(model, backend="twell", options=REWRITE_ALL)(x)


@pytest.mark.parametrize("where", ["outside", "checkpoint"])
def test_mixed_dtypes_under_autocast_are_rewritten(where: str) -> None:
    """Under autocast eager casts fp32 weights and a bf16 x to bf16, and so does the rewrite:
    autocast entered around the compiled call, or inside forward around checkpointing (the
    checkpointed subgraph inherits its caller's region)."""
    torch.manual_seed(0)
    model = Mixed("checkpoint" if where == "checkpoint" else "")
    x = torch.randn(3, 16).bfloat16().requires_grad_()
    backend = PassBackend()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "outside"):
        got = torch.compile(model, backend=backend)(x)
        want = model(x)
    assert backend.twell_ops() == ["twell::ffn_train"] and not backend.report.rejections
    ref = GatedMLP().double()
    ref.load_state_dict(model.mlp.state_dict())
    check_close("output", got, want, ref(x.double()))


def test_each_op_gets_an_instance_of_its_own() -> None:
    """Every op the pass inserts carries an instance number unique in the process (its runtime
    state's key): two FFNs of one graph, and a recompile of the same model, never share one."""
    from twell_compile.ops import arg_index

    model = nn.Sequential(GatedMLP(), GatedMLP())
    x = torch.randn(5, 16)
    seen = []
    for _ in range(2):
        torch._dynamo.reset()
        backend = PassBackend()
        with torch.no_grad():
            torch.compile(model, backend=backend)(x)
        op = torch.ops.twell.ffn.default
        seen += [n.args[arg_index(op, "instance")] for n in backend.nodes()
                 if n.op == "call_function" and n.target is op]
    assert len(seen) == 4 and len(set(seen)) == 4 and all(i > 0 for i in seen), seen


@pytest.mark.parametrize("cudagraphs, marked", [("on", True), ("", True), ("off", False)])
def test_inference_ops_compiled_for_cuda_graphs_plan_with_the_bounds_for_graphs(cudagraphs: str, marked: bool) -> None:
    """An inference op compiled where its graph runs inside CUDA graphs (reduce-overhead,
    twell.cudagraphs; unresolved counts as on, as static_reason reads it) is marked, so its
    calls, the eager ones before the recording included, plan with the record's bounds for
    graphs (density.in_graphs); a training op or a graph without CUDA graphs is not."""
    from twell_compile.ops import arg_index
    from twell_compile.runtime import density

    model = GatedMLP()
    x = torch.randn(5, 16)
    for grad in (False, True):
        torch._dynamo.reset()
        backend = PassBackend(TwellConfig(skip_dense=False, cudagraphs=cudagraphs))
        with torch.set_grad_enabled(grad):
            torch.compile(model, backend=backend)(x)
        ops = [n for n in backend.nodes() if n.op == "call_function" and str(n.target) in TWELL_OPS]
        assert len(ops) == 1
        instance = ops[0].args[arg_index(ops[0].target, "instance")]
        with density.scope(instance):
            assert density.in_graphs() == (marked and not grad), (cudagraphs, grad)
    with density.scope(0):                   # direct calls: only while capturing
        assert not density.in_graphs()


@pytest.mark.parametrize("grad", [False, True])
def test_no_tokens_compile_and_match_eager(grad: bool) -> None:
    """x [B, 0, K] through the real backend: an empty y, and as eager zero weight gradients."""
    model = GatedMLP()
    x = torch.randn(2, 0, 16, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        y = torch.compile(model, backend="twell", options=REWRITE_ALL)(x)
    assert y.shape == (2, 0, 16)
    if grad:
        y.sum().backward()
        assert x.grad.shape == x.shape
        assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def test_two_ffns_feeding_each_other_rewrite_both() -> None:
    """The second FFN reads the first's output directly (no residual in between)."""
    torch.manual_seed(0)
    model = nn.Sequential(GatedMLP(), GatedMLP())
    x = torch.randn(5, 16, requires_grad=True)
    backend = PassBackend()
    got = torch.compile(model, backend=backend)(x)
    want = model(x)
    assert backend.twell_ops() == ["twell::ffn_train"] * 2 and not backend.leftovers()
    check_close("output", got, want)
    dy = torch.randn_like(want)
    params = list(model.parameters())
    for a, b in zip(_grads(got, [x] + params, dy), _grads(want, [x] + params, dy)):
        check_close("grad", a, b)


# ------------------------------------------------------------------------------ broadcast biases
class BroadcastBias(nn.Module):
    """A gated FFN (or one with a fused gate+up) whose biases broadcast as F.linear and addmm
    allow: ``shape`` with "W" standing for the projection's width ([1], 0-d, [1, W], [W])."""

    def __init__(self, kind: str, shape: tuple, fused: bool = False, k: int = 8, n: int = 12):
        super().__init__()
        self.kind, self.fused = kind, fused
        size = lambda w: tuple(w if d == "W" else d for d in shape)  # noqa: E731
        self.w_gate = nn.Parameter(torch.randn(2 * n if fused else n, k) / k ** 0.5)
        self.w_down = nn.Parameter(torch.randn(k, n) / n ** 0.5)
        self.b_gate = nn.Parameter(torch.randn(size(2 * n if fused else n)))
        if not fused:
            self.w_up = nn.Parameter(torch.randn(n, k) / k ** 0.5)
            self.b_up = nn.Parameter(torch.randn(size(n)))
        self.b_down = nn.Parameter(torch.randn(size(k)))

    def proj(self, x, w, b):
        if self.kind == "F.linear":
            return F.linear(x, w, b)
        if self.kind == "addmm":
            return torch.addmm(b, x.reshape(-1, x.shape[-1]), w.t()).view(*x.shape[:-1], w.shape[0])
        return x @ w.t() + b                       # matmul + bias add

    def forward(self, x):
        if self.fused:
            g, u = self.proj(x, self.w_gate, self.b_gate).chunk(2, dim=-1)
        else:
            g, u = self.proj(x, self.w_gate, self.b_gate), self.proj(x, self.w_up, self.b_up)
        return self.proj(F.relu(g) * u, self.w_down, self.b_down)


@pytest.mark.parametrize("grad", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("shape", [(1,), (), (1, "W"), (1, 1)], ids=str)
@pytest.mark.parametrize("kind", ["F.linear", "addmm", "matmul+add"])
def test_broadcast_biases_are_expanded(kind: str, shape: tuple, fused: bool, grad: bool) -> None:
    """Biases of shape [1], 0-d or [1, N] (legal for F.linear and addmm; were matched, then
    refused at compile time): the rewrite expands them to [N]; in training their gradients
    (summed over the broadcast) equal eager's."""
    torch.manual_seed(0)
    model = BroadcastBias(kind, shape, fused)
    x = torch.randn(2, 3, 8)
    xs = [x.clone().requires_grad_(grad) for _ in range(2)]
    backend = PassBackend()
    with torch.set_grad_enabled(grad):
        got = torch.compile(model, backend=backend)(xs[0])
        want = model(xs[1])
    assert backend.twell_ops() == ["twell::ffn_train" if grad else "twell::ffn"], str(backend.report)
    assert not backend.leftovers(), backend.leftovers()
    expands = [n for n in backend.nodes() if n.op == "call_method" and n.target == "expand"]
    assert len(expands) == (0 if shape == (1, "W") else 3)     # one per projection (gate, up, down)
    check_close("output", got, want)
    if grad:
        dy = torch.randn_like(want)
        params = list(model.parameters())
        for name, a, b in zip(["x"] + [n for n, _ in model.named_parameters()],
                              _grads(got, [xs[0]] + params, dy), _grads(want, [xs[1]] + params, dy), strict=True):
            assert a.shape == b.shape, name
            check_close(f"grad {name}", a, b)


def test_broadcast_bias_through_inductor(monkeypatch) -> None:
    spy = CompileFxSpy(monkeypatch)
    torch.manual_seed(0)
    model = BroadcastBias("F.linear", (1,))
    xs = [torch.randn(4, 8).requires_grad_() for _ in range(2)]
    xs[1].data.copy_(xs[0].data)
    got = torch.compile(model, backend="twell", options=REWRITE_ALL)(xs[0])
    want = model(xs[1])
    ops, replaced = spy.node_kinds()
    assert ops == ["twell::ffn_train"] and not replaced
    check_close("output", got, want)
    dy = torch.randn_like(want)
    params = list(model.parameters())
    for a, b in zip(_grads(got, [xs[0]] + params, dy), _grads(want, [xs[1]] + params, dy), strict=True):
        check_close("grad", a, b)


@pytest.mark.parametrize("zshape", [(3,), (16,)], ids=["0-d", "per-feature"])
def test_add_of_another_dtype_after_down_is_not_its_bias(zshape):
    """The block's output plus a tensor of another dtype (a residual's fp32 mean, or an fp32
    per-feature tensor): the add is not the down projection's bias, and add's promotion keeps
    x's dtype for a 0-d fp32."""
    torch.manual_seed(0)
    model = PlusMean(GatedMLP()).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    z = torch.randn(zshape) if zshape == (3,) else torch.randn(16)
    if zshape == (16,):
        model.forward = lambda x, z, m=model.mlp: m.down(F.relu(m.gate(x)) * m.up(x)) + z
    with torch.no_grad():
        report = twell_compile.explain(model, x, z, options=REWRITE_ALL)
        assert [r.op for r in report.rewrites] == ["twell::ffn"], str(report)
        got = torch.compile(model, backend=PassBackend())(x, z)
        want = model(x, z)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------ layer names
class BreakingBlock(nn.Module):
    """A residual block whose forward graph-breaks first: Dynamo compiles it as a frame of its
    own (rooted at the block, not the model), as a block under gradient checkpointing or after
    a graph break in its caller is."""

    def __init__(self):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(16), GatedMLP()

    def forward(self, x):
        torch._dynamo.graph_break()
        return x + self.mlp(self.norm(x))


class BrokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.block = nn.Linear(16, 16), BreakingBlock()

    def forward(self, x):
        return self.block(self.embed(x))


@pytest.mark.parametrize("grad", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("wrap", ["compile", "compiled-module"])
def test_layer_names_are_model_paths_in_a_frame_of_their_own(grad: bool, wrap: str) -> None:
    """The block's frame roots its sources at the block (``L['self'].mlp``); the FFN is still
    named by its path in the model, as prepare and an unbroken graph name it."""
    torch.manual_seed(0)
    model = BrokenModel()
    x = torch.randn(2, 5, 16, requires_grad=grad)
    backend = PassBackend()
    with torch.set_grad_enabled(grad):
        if wrap == "compile":
            got = torch.compile(model, backend=backend)(x)
        else:
            model.compile(backend=backend)
            got = model(x)
        want = BrokenModel.forward(model, x)
    assert len(backend.graphs) >= 2                  # the break gave the block a frame of its own
    assert [r.layer for r in backend.report.rewrites] == ["block.mlp"], str(backend.report)
    check_close("output", got, want)
    assert [r.layer for r in twell_compile.prepare(copy.deepcopy(model)).rewrites] == ["block.mlp"]


# ------------------------------------------------------------------------------ squared ReLU, dReLU
def _act_of(backend: PassBackend) -> list[str]:
    """The ``act`` of every twell op node ("relu" where the schema's default is left)."""
    from twell_compile.ops import arg_index

    out = []
    for n in backend.nodes():
        if n.op == "call_function" and str(n.target) in TWELL_OPS:
            pos = arg_index(n.target, "act")
            out.append(str(n.args[pos] if len(n.args) > pos else n.kwargs.get("act", "relu")))
    return out


@pytest.mark.parametrize("grad", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "non-gated"])
@pytest.mark.parametrize("square", ["**2", "**2.0", "torch.pow", "Tensor.pow", "torch.square", "Tensor.square",
                                    "relu*relu", "ReLUSquared"])
def test_squared_relu_every_spelling(square: str, gated: bool, grad: bool) -> None:
    """relu(g)^2 [* u] in each spelling: one op with act="relu2", no pow/square/relu/mul left,
    output and every gradient as eager's (fp64 and bf16 against fp64 under the 2x rule)."""
    for dtype in (torch.float64, torch.bfloat16):
        spec = Spec(act="relu2", square=square, gated=gated, bias=True, k=12, n=37, k_out=9, batch=(3, 5))
        torch._dynamo.reset()
        model = build(spec, dtype, seed=7)
        backend = PassBackend()
        _compare(spec, dtype, 7, model, torch.compile(model, backend=backend), grad, True, True)
        assert backend.twell_ops() == [_expected_op(grad, True, True)], spec.describe()
        assert _act_of(backend) == ["relu2"] and not backend.leftovers(), backend.leftovers()
        assert [r.act for r in backend.report.rewrites] == ["relu2"] and not backend.report.rejections


@pytest.mark.parametrize("grad", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("split, relu", [(None, "F.relu"), ("chunk", "F.relu"), ("slice", "relu_"), (None, "nn.ReLU")])
def test_drelu_is_rewritten(split, relu: str, grad: bool) -> None:
    """relu(gate(x)) * relu(up(x)) (TurboSparse's dReLU): one op with act="drelu", exact."""
    for dtype in (torch.float64, torch.bfloat16):
        spec = Spec(act="drelu", split=split, relu=relu, bias=True, relu_first=False, k=12, n=37, k_out=9,
                    batch=(3, 5))
        if not eager_allows(spec, grad):
            continue
        torch._dynamo.reset()
        model = build(spec, dtype, seed=3)
        backend = PassBackend()
        _compare(spec, dtype, 3, model, torch.compile(model, backend=backend), grad, True, True)
        assert backend.twell_ops() == [_expected_op(grad, True, True)] and _act_of(backend) == ["drelu"]
        assert not backend.leftovers(), backend.leftovers()


class SquareAfterDown(nn.Module):
    """A square applied after the down projection: the ReLU FFN is rewritten, the square stays."""

    def __init__(self):
        super().__init__()
        self.mlp = GatedMLP()

    def forward(self, x):
        return self.mlp(x) ** 2


@pytest.mark.parametrize("grad", [False, True], ids=["infer", "train"])
def test_square_after_down_stays_outside_the_op(grad: bool) -> None:
    torch.manual_seed(0)
    model = SquareAfterDown()
    x = torch.randn(2, 5, 16, requires_grad=grad)
    backend = PassBackend()
    with torch.set_grad_enabled(grad):
        got = torch.compile(model, backend=backend)(x)
        want = model(x)
    assert _act_of(backend) == ["relu"]
    pows = [n for n in backend.nodes() if n.op == "call_function" and n.target is operator.pow]
    assert len(pows) == 1                                  # the square, after the op
    check_close("output", got, want)
    if grad:
        dy = torch.randn_like(want)
        for a, b in zip(_grads(got, [x, *model.parameters()], dy), _grads(want, [x, *model.parameters()], dy)):
            check_close("grad", a, b)


def test_squared_relu_and_drelu_through_inductor(monkeypatch) -> None:
    """The real backend: the ops (with act) reach compile_fx, Inductor compiles around them."""
    spy = CompileFxSpy(monkeypatch)
    for spec in (Spec(act="relu2", square="torch.square", gated=False, k=16, n=40, k_out=16, batch=(2, 7)),
                 Spec(act="drelu", split="chunk", bias=True, k=16, n=40, k_out=16, batch=(2, 7))):
        torch._dynamo.reset()
        model = build(spec, torch.float32, seed=1)
        x = torch.randn(*spec.batch, spec.k, requires_grad=True)
        got = torch.compile(model, backend="twell", options=REWRITE_ALL)(x)
        want = model(x)
        check_close("output", got, want)
        dy = torch.randn_like(want)
        params = list(model.parameters())
        for a, b in zip(_grads(got, [x] + params, dy), _grads(want, [x] + params, dy)):
            check_close("grad", a, b)
    ops, replaced = spy.node_kinds()
    assert ops == ["twell::ffn_train"] * 2 and not replaced, (ops, replaced)
