"""The twell backend end to end on CPU: options, Inductor hand-off, L1, stats, autocast."""

import subprocess
from unittest import mock
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import twell_compile
from tests.helpers import REWRITE_ALL
from twell_compile.testing import GatedMLP
from twell_compile import backend as backend_mod


class Net(nn.Module):
    def __init__(self, layers=2, k=16, n=40):
        super().__init__()
        self.mlps = nn.ModuleList(GatedMLP(k, n) for _ in range(layers))
        self.norm = nn.LayerNorm(k)

    def forward(self, x):
        for mlp in self.mlps:
            x = x + mlp(self.norm(x))
        return x


def hidden(net, x):
    """The h of every layer, computed as eager does."""
    hs = []
    for mlp in net.mlps:
        xn = net.norm(x)
        h = F.relu(mlp.gate(xn)) * mlp.up(xn)
        hs.append(h)
        x = x + mlp.down(h)
    return x, hs


def test_backend_rewrites_and_matches_eager_forward_and_backward():
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(3, 5, 16, requires_grad=True)
    ref = net(x)
    ref.square().sum().backward()
    ref_grads = [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]
    net.zero_grad()
    x.grad = None
    out = torch.compile(net, backend="twell", options=REWRITE_ALL)(x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    for a, b in zip(ref_grads, [p.grad for p in net.parameters()] + [x.grad]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    report = twell_compile.explain(net, x, options=REWRITE_ALL)
    assert [r.op for r in report.rewrites] == ["twell::ffn_train"] * 2
    assert [r.layer for r in report.rewrites] == ["mlps.0", "mlps.1"]


def test_no_grad_uses_inference_op():
    net = Net()
    x = torch.randn(4, 16)
    with torch.no_grad():
        report = twell_compile.explain(net, x, options=REWRITE_ALL)
        out = torch.compile(net, backend="twell", options=REWRITE_ALL)(x)
        torch.testing.assert_close(out, net(x), atol=1e-5, rtol=1e-5)
    assert [r.op for r in report.rewrites] == ["twell::ffn"] * 2


def test_l1_option_matches_autograd_of_explicit_penalty():
    torch.manual_seed(1)
    net = Net(layers=3)
    x = torch.randn(2, 7, 16)
    coef = 0.05
    out, hs = hidden(net, x)
    (out.sum() + coef * torch.stack([h.abs().mean() for h in hs]).mean()).backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    torch.compile(net, backend="twell", options={"twell.l1": coef})(x).sum().backward()
    for a, p in zip(ref, net.parameters()):
        torch.testing.assert_close(p.grad, a, atol=1e-5, rtol=1e-5)
    # Without the option the gradient differs: the test can fail.
    net.zero_grad()
    torch._dynamo.reset()
    torch.compile(net, backend="twell", options=REWRITE_ALL)(x).sum().backward()
    assert any(not torch.allclose(p.grad, a, atol=1e-6) for a, p in zip(ref, net.parameters()))


def test_l1_layers_option_overrides_layer_count():
    torch.manual_seed(2)
    net = Net(layers=2)
    x = torch.randn(6, 16)
    out, hs = hidden(net, x)
    (out.sum() + 0.1 * sum(h.abs().mean() for h in hs) / 4).backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    torch.compile(net, backend="twell", options={"twell.l1": 0.1, "twell.l1_layers": 4})(x).sum().backward()
    for a, p in zip(ref, net.parameters()):
        torch.testing.assert_close(p.grad, a, atol=1e-5, rtol=1e-5)


def test_layer_stats_after_a_step():
    twell_compile.reset_stats()
    net = Net()
    x = torch.randn(4, 3, 16)
    torch.compile(net, backend="twell", options=REWRITE_ALL)(x).sum().backward()
    stats = twell_compile.layer_stats()
    assert set(stats) == {"mlps.0", "mlps.1"}
    _, hs = hidden(net, x)
    for name, h in zip(("mlps.0", "mlps.1"), hs):
        s = stats[name]
        nnz = (h.reshape(-1, 40) != 0).sum(-1).float()
        assert s.tokens == 12 and s.hidden == 40
        assert s.mean_nnz == pytest.approx(nnz.mean().item())
        assert s.l1 == pytest.approx(h.abs().mean().item(), rel=1e-4)
        assert 0 < s.density < 1


def test_blocks_sharing_one_graph_run_under_their_own_names_and_instances(monkeypatch):
    """``module.compile()`` on every block: Dynamo compiles one graph for all of them (their
    parameters are its inputs). Each call names its FFN by the module holding its weights, so
    layer_stats, the L1 controller and the op instance (its runtime state) are each block's, in
    inference and training; a second model of the class runs the same graph under instances of
    its own."""
    from torch._dynamo.utils import counters

    from twell_compile import control
    from twell_compile.runtime import execute

    seen = []          # (layer, instance) of every call
    for fn, at in (("ffn_infer", (7, 9)), ("ffn_train_forward", (9, 11))):
        def spy(*args, _real=getattr(execute, fn), _at=at, **kwargs):
            seen.append((args[_at[0]], args[_at[1]]))
            return _real(*args, **kwargs)
        monkeypatch.setattr(execute, fn, spy)

    def compiled_net():
        net = Net(layers=3)
        for mlp in net.mlps:
            mlp.compile(backend="twell", options={**REWRITE_ALL, "twell.target_density": 0.3})
        return net

    names = ["mlps.0", "mlps.1", "mlps.2"]
    torch.manual_seed(0)
    net = compiled_net()
    x = torch.randn(4, 3, 16)
    twell_compile.reset_stats()
    counters.clear()
    with torch.no_grad():
        y = net(x)
    assert counters["stats"]["unique_graphs"] == 1          # one graph, run by the three blocks
    ref, hs = hidden(net, x)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    stats = twell_compile.layer_stats()
    assert sorted(stats) == names
    for name, h in zip(names, hs):
        assert stats[name].mean_nnz == pytest.approx((h.reshape(-1, 40) != 0).sum(-1).float().mean().item())
    assert [layer for layer, _ in seen] == names and len({i for _, i in seen}) == 3
    seen.clear()
    net(x).sum().backward()
    assert [layer for layer, _ in seen] == names and len({i for _, i in seen}) == 3
    assert sorted(twell_compile.layer_stats()) == names and control.layers() == names
    first = {i for _, i in seen}
    seen.clear()
    other = compiled_net()
    other(x).sum().backward()
    assert [layer for layer, _ in seen] == names and not {i for _, i in seen} & first


def test_autocast_region_keeps_autocast_numerics():
    torch.manual_seed(3)
    net = Net()
    x = torch.randn(5, 16)

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return net(x)

    with torch.no_grad():
        ref = f(x)
        report = twell_compile.explain(f, x, options=REWRITE_ALL)
        out = torch.compile(f, backend="twell", options=REWRITE_ALL)(x)
    assert len(report.rewrites) == 2 and report.rewrites[0].dtype == "bfloat16"
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_unknown_options_raise():
    net = Net()
    with pytest.raises(Exception, match="unknown twell option"):
        torch.compile(net, backend="twell", options={"twell.nope": 1})(torch.randn(2, 16))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="neither a twell"):
        torch.compile(net, backend="twell", options={"not_an_inductor_key": 1})(torch.randn(2, 16))


def test_mode_and_inductor_options_reach_compile_fx(monkeypatch):
    seen = {}
    real = backend_mod.__dict__.get("compile_fx")

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kw):
        seen["patches"] = dict(config_patches or {})
        seen["tag"] = torch.compiler.config.cache_key_tag
        seen["targets"] = [str(n.target) for n in gm.graph.nodes]
        return gm.forward

    import torch._inductor.compile_fx as cfx
    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    assert real is None  # imported lazily inside the backend, so the patch above is what runs
    net = Net()
    torch.compile(net, backend="twell", options={"twell.mode": "max-autotune-no-cudagraphs", **REWRITE_ALL})(
        torch.randn(2, 16))
    assert seen["patches"].get("max_autotune") is True
    assert "twell-" in seen["tag"] and "l1=0.0" in seen["tag"]
    assert any("twell.ffn" in t for t in seen["targets"])
    torch._dynamo.reset()
    torch.compile(net, backend="twell", options={"epilogue_fusion": False, "twell.l1": 1e-4, **REWRITE_ALL})(
        torch.randn(2, 16))
    assert seen["patches"] == {"epilogue_fusion": False}
    assert "l1=0.0001" in seen["tag"]


def test_enabled_false_leaves_graph_to_inductor():
    net = Net()
    report = twell_compile.explain(net, torch.randn(2, 16), options={"twell.enabled": False})
    assert not report.rewrites and len(report.rejections) == 2
    assert "twell.enabled is False" in str(report)


def test_backend_found_through_entry_point_without_import():
    code = (
        "import sys, torch\n"
        "m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))\n"
        "x = torch.randn(3, 8)\n"
        "with torch.no_grad():\n"
        "    y = torch.compile(m, backend='twell')(x)\n"
        "    assert torch.allclose(y, m(x), atol=1e-5)\n"
        "assert 'twell_compile' in sys.modules\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ok")


def test_import_initialises_no_cuda_and_builds_nothing():
    code = (
        "import sys, torch, twell_compile, twell_compile.ops, twell_compile.passes\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert not any(m.startswith('twell_') and m != 'twell_compile' and not m.startswith('twell_compile.') for m in sys.modules)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_explain_rejects_non_callable():
    with pytest.raises(TypeError, match="model must be callable"):
        twell_compile.explain(42)


def test_stats_buffers_are_reserved_at_compile_time(monkeypatch):
    """Buffers first allocated during a CUDA-graph warm-up would land in the graph's pool: by
    the time the backend hands the graph to Inductor, every layer's buffer exists (stats.snapshot
    lists the buffers held), before any call ran."""
    import torch._inductor.compile_fx as cfx

    from twell_compile import stats

    twell_compile.reset_stats()
    reserved = []
    real = cfx.compile_fx

    def compile_fx(gm, example_inputs, **kw):
        reserved.append(sorted(stats.snapshot()[0]))
        return real(gm, example_inputs, **kw)

    monkeypatch.setattr(cfx, "compile_fx", compile_fx)
    with torch.no_grad():
        torch.compile(Net(), backend="twell", options=REWRITE_ALL)(torch.randn(3, 16))
    cpu = torch.device("cpu")
    assert reserved == [[("mlps.0", cpu), ("mlps.1", cpu)]]
    assert set(twell_compile.layer_stats()) == {"mlps.0", "mlps.1"}


def test_twell_mode_option_applies_the_mode(monkeypatch):
    """torch.compile refuses mode= with options=; twell.mode carries the mode instead."""
    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kw):
        seen["patches"] = dict(config_patches or {})
        return gm.forward

    import torch._inductor.compile_fx as cfx
    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    torch.compile(Net(), backend="twell", options={"twell.mode": "max-autotune-no-cudagraphs", "twell.l1": 1e-5})(
        torch.randn(2, 16))
    assert seen["patches"].get("max_autotune") is True
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown torch.compile mode"):
        torch.compile(Net(), backend="twell", options={"twell.mode": "warp-speed"})(torch.randn(2, 16))


@pytest.mark.parametrize("mode, option, want", [(None, "", "off"), ("reduce-overhead", "", "on"),
                                                ("max-autotune-no-cudagraphs", "", "off"),
                                                (None, "on", "on"), ("reduce-overhead", "off", "off")])
def test_cudagraphs_option_resolves_from_the_mode(monkeypatch, mode, option, want):
    """The passes see whether the compiled graph replays CUDA graphs (the decode-size rule of
    select.static_reason needs it): from the mode unless twell.cudagraphs says."""
    import sys

    explain_mod = sys.modules["twell_compile.explain"]
    seen = {}
    real = explain_mod.run_passes

    def spy(gm, config):
        seen["cudagraphs"] = config.cudagraphs
        return real(gm, config)

    monkeypatch.setattr(explain_mod, "run_passes", spy)
    options = {"twell.cudagraphs": option} if option else {}
    if mode:
        options["twell.mode"] = mode
    torch._dynamo.reset()
    twell_compile.explain(Net(), torch.randn(2, 16), options=options)
    assert seen["cudagraphs"] == want


@pytest.mark.parametrize("cudagraphs", ["on", "off"])
def test_graphs_for_cuda_graphs_wait_for_first_measurements(cudagraphs):
    """With CUDA graphs on, the backend's callable waits after a call for the first density
    measurements it made (backend.settled: the recording call then sees them), called as
    Inductor's callable is, in inference and training; off, Inductor's callable as it is."""
    seen = {}
    real = backend_mod.settled

    def spy(compiled):
        seen["wrapped"] = True
        return real(compiled)

    torch._dynamo.reset()
    net = Net()
    x = torch.randn(2, 16, requires_grad=True)
    with mock.patch.object(backend_mod, "settled", spy):
        f = torch.compile(net, backend="twell", options={"twell.cudagraphs": cudagraphs})
        y = f(x)
    assert seen.get("wrapped", False) == (cudagraphs == "on")
    assert torch.allclose(y, net(x), atol=1e-5)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
