"""No stale weights: every way of changing or rebinding a weight is seen by the next compiled
call, on the CPU kernel, the CUDA decode path (CUDA-graph replays included), the CUDA sparse
path and in training, each against eager on the same module.

The kernels read the parameters themselves at every call (no derived copy), so updates that
bump no version counter (``.data`` ops, fused optimizers) are covered like any other.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import twell_compile  # noqa: F401  (registers the backend and the ops)
from twell_compile.testing import GatedMLP

gpu = pytest.mark.gpu
# the CPU tests run the C++ kernel (forced: these layers are under its token count) and, where
# they train, our backward (rewritten although CPU training has no penalty here)
ON_CPU_KERNEL = {"twell.path": "cpu", "twell.skip_dense": False}


def _model(k: int, n: int, device: str, dtype: torch.dtype, seed: int = 0) -> GatedMLP:
    torch.manual_seed(seed)
    m = GatedMLP(k, n, bias=True).to(device=device, dtype=dtype)
    with torch.no_grad():
        m.gate.bias.fill_(-1.3)           # sparse: ~10% of the gates positive
    return m


def _fresh_weight(p: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])).to(p.device, p.dtype)


# Each mutation changes the module in place; it returns nothing. ``m`` is the compiled module's
# original (the compiled wrapper shares its parameters).
def _data_mul(m):
    m.down.weight.data.mul_(2)


def _data_slice_zero(m):
    m.down.weight.data[:10].zero_()
    m.up.weight.data[:, :3].zero_()


def _data_copy(m):
    m.down.weight.data.copy_(_fresh_weight(m.down.weight, 1))


def _data_rebind(m):
    m.down.weight.data = _fresh_weight(m.down.weight, 2)
    m.gate.weight.data = _fresh_weight(m.gate.weight, 3)


def _copy_no_grad(m):
    with torch.no_grad():
        m.up.weight.copy_(_fresh_weight(m.up.weight, 4))
        m.down.bias.add_(0.5)


def _load_state_dict(m):
    sd = {k: _fresh_weight(v, 5 + i) if v.dim() == 2 else v + 0.1 for i, (k, v) in enumerate(m.state_dict().items())}
    m.load_state_dict(sd)


def _set_(m):
    with torch.no_grad():
        m.down.weight.set_(_fresh_weight(m.down.weight, 9))


def _tie(m):
    m.up.weight = m.gate.weight           # weight tying: up now reads gate's parameter


def _optimizer(kind: str, **kw):
    def step(m):
        opt = getattr(torch.optim, kind)(m.parameters(), lr=0.5, **kw)
        for p in m.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    step.__name__ = f"{kind}_{'_'.join(kw) or 'default'}"
    return step


MUTATIONS = [_data_mul, _data_slice_zero, _data_copy, _data_rebind, _copy_no_grad, _load_state_dict,
             _set_, _tie, _optimizer("SGD"), _optimizer("SGD", fused=True), _optimizer("Adam", fused=True),
             _optimizer("AdamW", fused=True), _optimizer("AdamW", foreach=True)]
IDS = [f.__name__.lstrip("_") for f in MUTATIONS]


def _close(got: torch.Tensor, want: torch.Tensor, ref: torch.Tensor) -> None:
    """The 2x rule against fp64 for low precision; tight for fp32."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        return
    err = (got.double() - ref).norm() / ref.norm()
    eager = (want.double() - ref).norm() / ref.norm()
    assert err <= 2 * eager + 1e-6, f"error {err:.3g} vs eager's {eager:.3g}"


def _check_inference(model: GatedMLP, compiled, x: torch.Tensor, mutate, calls: int = 3) -> None:
    with torch.no_grad():
        for _ in range(calls):             # measured densities and captured graphs in place
            compiled(x)
        mutate(model)
        for _ in range(calls):
            got = compiled(x).clone()
            want = model(x)
            plain = copy.deepcopy(model)
            twell_compile.unprepare(plain)          # the fp64 reference runs the plain forward
            ref = plain.double()(x.double())
            _close(got, want, ref)


def _check_training(model: GatedMLP, compiled, x: torch.Tensor, mutate) -> None:
    def grads(f):
        model.zero_grad(set_to_none=True)
        y = f(x)
        y.float().square().mean().backward()
        return y.detach(), [p.grad.clone() for p in model.parameters()]

    grads(compiled)
    mutate(model)
    model.zero_grad(set_to_none=True)
    y, g = grads(compiled)
    y_eager, g_eager = grads(model)
    ref = copy.deepcopy(model).double()
    torch.testing.assert_close(y.float(), y_eager.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(g, g_eager):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * max(1.0, b.abs().max().item()))
    del ref


# ---------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("mutate", MUTATIONS, ids=IDS)
def test_cpu_inference_sees_every_weight_update(mutate):
    model = _model(64, 256, "cpu", torch.float32)
    x = torch.randn(8, 64)
    _check_inference(model, torch.compile(model, backend="twell", options=ON_CPU_KERNEL), x, mutate)


@pytest.mark.parametrize("mutate", [_data_mul, _data_rebind, _set_, _optimizer("AdamW", fused=True)],
                         ids=["data_mul", "data_rebind", "set_", "AdamW_fused"])
def test_cpu_prepared_model_sees_every_weight_update(mutate):
    model = _model(64, 256, "cpu", torch.float32)
    twell_compile.prepare(model, options=ON_CPU_KERNEL)
    x = torch.randn(8, 64)
    try:
        _check_inference(model, model, x, mutate)
    finally:
        twell_compile.unprepare(model)


@pytest.mark.parametrize("mutate", MUTATIONS, ids=IDS)
def test_cpu_training_sees_every_weight_update(mutate):
    model = _model(32, 96, "cpu", torch.float32)
    x = torch.randn(6, 32)
    _check_training(model, torch.compile(model, backend="twell", options={"twell.l1": 1e-3}), x, mutate)


def test_cpu_fused_optimizer_train_eval_rounds_match_eager():
    """The fuzzing report: fused AdamW updates (no version bump) between train and eval calls."""
    model = _model(64, 256, "cpu", torch.float32)
    x = torch.randn(8, 64)
    with torch.no_grad():
        assert [r.op for r in twell_compile.explain(model, x, options=ON_CPU_KERNEL).rewrites] == ["twell::ffn"]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="twell", options=ON_CPU_KERNEL)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    for _ in range(3):
        compiled(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------- CUDA
def _cuda_case(m_tokens: int):
    model = _model(2048, 5632, "cuda", torch.bfloat16)
    x = torch.randn(m_tokens, 2048, device="cuda", dtype=torch.bfloat16)
    return model, x


@gpu
@pytest.mark.parametrize("mutate", MUTATIONS, ids=IDS)
def test_cuda_decode_path_sees_every_weight_update(mutate):
    """M=1 under reduce-overhead: the decode path replayed from CUDA graphs. Where Inductor's own
    replay sees the update, ours must too."""
    model, x = _cuda_case(1)
    base = copy.deepcopy(model)
    inductor_ok = True
    try:
        _check_inference(base, torch.compile(base, backend="inductor", mode="reduce-overhead"), x, mutate)
    except AssertionError:
        inductor_ok = False
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="twell", mode="reduce-overhead")
    if inductor_ok:
        _check_inference(model, compiled, x, mutate)


@gpu
@pytest.mark.parametrize("mutate", MUTATIONS, ids=IDS)
def test_cuda_sparse_path_sees_every_weight_update(mutate):
    """M=8192: the per-row TwELL path once the layer's density has been measured."""
    model, x = _cuda_case(8192)
    _check_inference(model, torch.compile(model, backend="twell"), x, mutate, calls=4)


@gpu
@pytest.mark.parametrize("mutate", [_data_mul, _data_rebind, _set_, _optimizer("AdamW", fused=True)],
                         ids=["data_mul", "data_rebind", "set_", "AdamW_fused"])
def test_cuda_training_sees_every_weight_update(mutate):
    model, x = _cuda_case(8192)
    _check_training(model, torch.compile(model, backend="twell", options={"twell.l1": 1e-3}), x, mutate)


# ---------------------------------------------------------------------------- fuzz (CPU)
from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=12, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(range(len(MUTATIONS))), st.booleans()), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_fuzz_mutation_sequences_against_eager(steps, seed):
    """Random sequences of weight updates (every path above, optimizers included) with
    inference calls or training steps between them: each compiled result matches eager."""
    torch._dynamo.reset()
    model = _model(64, 256, "cpu", torch.float32, seed=seed)
    compiled = torch.compile(model, backend="twell", options=ON_CPU_KERNEL)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(seed))
    for which, train in steps:
        MUTATIONS[which](model)
        if train:
            model.zero_grad(set_to_none=True)
            got = compiled(x)
            got.square().mean().backward()
            g_got = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            want = model(x)
            want.square().mean().backward()
            for a, b in zip(g_got, [p.grad for p in model.parameters()]):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        else:
            with torch.no_grad():
                got, want = compiled(x), model(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_parametrized_weights_are_exact_and_keep_no_state_per_call():
    """weight_norm recomputes the weight every call (a fresh tensor each time): results follow
    the parametrization's parameters, and nothing is kept per call (no cache to grow)."""
    import gc

    from torch.nn.utils.parametrizations import weight_norm

    model = _model(64, 256, "cpu", torch.float32)
    weight_norm(model.down)
    weight_norm(model.up)
    compiled = torch.compile(model, backend="twell", options=ON_CPU_KERNEL)
    x = torch.randn(8, 64)
    with torch.no_grad():
        assert [r.op for r in twell_compile.explain(model, x, options=ON_CPU_KERNEL).rewrites] == ["twell::ffn"]
        for _ in range(3):
            compiled(x)
        gc.collect()
        before = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
        for i in range(30):
            model.down.parametrizations.weight.original0.data.mul_(1.01)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        gc.collect()
        after = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
    assert after - before < 10, (before, after)
