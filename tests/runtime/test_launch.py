"""runtime/launch.py: cached launches through the compiled kernel's own launcher. CPU: which
launches take the standard path; GPU (@pytest.mark.gpu): the cached launch computes what the
standard one does, a new specialization (alignment, int values, constexprs) is never served a
kernel compiled for another, CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

from twell_compile.runtime import launch as L


class _FakeKernel:
    """Records kernel[grid](*args, **kwargs) calls (stands in for a non-JIT kernel)."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append((grid, a, kw))


def test_non_jit_kernel_takes_the_standard_launch():
    k = _FakeKernel()
    before = L.cached()
    L.launch(k, (5,), (1, 2.0, None), dict(A=3, B=True), num_warps=4)
    L.launch(k, (5, 2), (1,), dict(A=4), num_warps=8, num_stages=3)
    L.launch(k, (5,), (1,), dict(A=4), num_warps=4, maxnreg=128)
    assert k.calls == [((5, 1, 1), (1, 2.0, None), dict(A=3, B=True, num_warps=4)),
                       ((5, 2, 1), (1,), dict(A=4, num_warps=8, num_stages=3)),
                       ((5, 1, 1), (1,), dict(A=4, num_warps=4, maxnreg=128))]
    assert L.cached() == before


def test_pdl_only_for_cuda_devices_and_never_under_the_interpreter():
    """Programmatic dependent launch needs a CUDA device of compute capability 9.0+ and the
    compiled kernels (the interpreter has no griddepcontrol)."""
    assert not L.pdl_ok(torch.device("cpu"))
    if L.INTERPRET or not torch.cuda.is_available():
        return
    major = torch.cuda.get_device_capability()[0]
    assert L.pdl_ok(torch.device("cuda")) == (L.PDL and major >= 9)


def test_fast_enabled_follows_the_environment(monkeypatch):
    monkeypatch.delenv("TWELL_TRITON_LAUNCH", raising=False)
    assert L.fast_enabled()
    monkeypatch.setenv("TWELL_TRITON_LAUNCH", "standard")
    assert not L.fast_enabled()


# ----------------------------------------------------------------------------- GPU
def _relu_mul(g, u, block=64, maxnreg=0):
    from twell_compile.kernels.relu_mul import relu_mul_rows_kernel

    m, n = g.shape
    h = torch.full_like(g, float("nan"))                       # poisoned
    cnt = torch.full((m,), -7, dtype=torch.int32, device=g.device)
    asum = torch.full((m,), float("nan"), dtype=torch.float32, device=g.device)
    L.launch(relu_mul_rows_kernel, (m, 1), (g, u, h, cnt, asum, n, n, g.stride(0), u.stride(0), h.stride(0)),
             dict(GATED=True, ATOMIC=False, BLOCK=block, ACT=0), num_warps=4, maxnreg=maxnreg)
    return h, cnt, asum


def _expect(g, u):
    h = torch.relu(g) * u
    return h, (torch.relu(g) != 0).sum(1).to(torch.int32), h.float().abs().sum(1)


def _check(g, u, block=64, maxnreg=0):
    h, cnt, asum = _relu_mul(g, u, block, maxnreg)
    eh, ecnt, esum = _expect(g, u)
    assert torch.equal(h, eh)
    assert torch.equal(cnt, ecnt)
    torch.testing.assert_close(asum, esum, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_cached_launch_matches_eager_and_is_reused():
    L.clear()
    for i in range(4):                      # fresh inputs each call: the cached runner serves 3
        g = torch.randn(8, 48, device="cuda", dtype=torch.bfloat16)
        u = torch.randn(8, 48, device="cuda", dtype=torch.bfloat16)
        _check(g, u)
        assert L.cached() == 1


@pytest.mark.gpu
def test_new_specializations_get_their_own_kernel():
    L.clear()
    base = torch.randn(8 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    u = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    _check(base[:8 * 64].view(8, 64), u)                    # 16-byte aligned, n = 64
    _check(base[1:8 * 64 + 1].view(8, 64), u)               # 2 bytes off: not aligned
    assert L.cached() == 2
    g = torch.randn(8, 63, device="cuda", dtype=torch.bfloat16)
    _check(g, torch.randn(8, 63, device="cuda", dtype=torch.bfloat16))    # n = 63: no %16
    _check(g[:1], torch.randn(1, 63, device="cuda", dtype=torch.bfloat16))  # M = 1
    _check(g, torch.randn(8, 63, device="cuda", dtype=torch.bfloat16), block=128)  # constexpr
    gh = torch.randn(8, 63, device="cuda", dtype=torch.float16)
    _check(gh, torch.randn(8, 63, device="cuda", dtype=torch.float16))  # dtype
    assert L.cached() == 6


@pytest.mark.gpu
def test_a_register_cap_is_its_own_specialization():
    L.clear()
    g = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    u = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    _check(g, u)
    _check(g, u, maxnreg=32)                 # compiled anew under the cap, the same results
    assert L.cached() == 2


@pytest.mark.gpu
def test_standard_launch_when_asked(monkeypatch):
    L.clear()
    monkeypatch.setenv("TWELL_TRITON_LAUNCH", "standard")
    _check(torch.randn(4, 32, device="cuda", dtype=torch.bfloat16),
           torch.randn(4, 32, device="cuda", dtype=torch.bfloat16))
    assert L.cached() == 0


@pytest.mark.gpu
def test_constexprs_out_of_order_raise():
    from twell_compile.kernels.relu_mul import relu_mul_rows_kernel

    L.clear()
    g = torch.randn(2, 16, device="cuda", dtype=torch.bfloat16)
    h = torch.empty_like(g)
    c = torch.empty(2, dtype=torch.int32, device="cuda")
    s = torch.empty(2, dtype=torch.float32, device="cuda")
    with pytest.raises(TypeError, match="constexpr"):
        L.launch(relu_mul_rows_kernel, (2, 1), (g, g, h, c, s, 16, 16, 16, 16, 16),
                 dict(BLOCK=16, GATED=True, ATOMIC=False), num_warps=4)


@pytest.mark.gpu
def test_cached_launch_in_a_cuda_graph():
    L.clear()
    g = torch.randn(8, 48, device="cuda", dtype=torch.bfloat16)
    u = torch.randn(8, 48, device="cuda", dtype=torch.bfloat16)
    _relu_mul(g, u)                         # first call: compiles, caches
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _relu_mul(g, u)               # the cached runner, captured
    for _ in range(3):
        g.copy_(torch.randn_like(g))
        u.copy_(torch.randn_like(u))
        graph.replay()
        torch.cuda.synchronize()
        eh, ecnt, _ = _expect(g, u)
        assert torch.equal(out[0], eh)
        assert torch.equal(out[1], ecnt)
