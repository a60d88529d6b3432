"""twell_compile.prepare without torch.distributed: which modules become one twell op, and a
prepared model's eager and compiled outputs and gradients equal the unprepared eager model's."""

import copy
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import twell_compile
from tests.helpers import REWRITE_ALL, twell_op_calls
from twell_compile.testing import Block, FusedMLP, GatedMLP
from twell_compile.prepare import spec_of



class Gated(GatedMLP):            # with biases
    def __init__(self, k=16, n=40, bias=True):
        super().__init__(k, n, bias)


class Plain(nn.Module):          # non-gated, ReLU as a module
    def __init__(self, k=16, n=40):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(k, n), nn.ReLU(), nn.Linear(n, k)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class RawMatmul(nn.Module):      # parameters used directly, one stored transposed
    def __init__(self, k=16, n=40):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, k) / k ** 0.5)
        self.w3 = nn.Parameter(torch.randn(k, n) / k ** 0.5)   # [K, N]: x @ w3
        self.w2 = nn.Parameter(torch.randn(k, n) / n ** 0.5)

    def forward(self, x):
        return (x @ self.w1.t()).relu().mul(x @ self.w3) @ self.w2.t()


class Silu(Gated):
    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Leaky(Gated):              # the activation has another user
    def forward(self, x):
        h = F.relu(self.gate(x))
        return self.down(h * self.up(x)) + h.mean()


class Residual(Gated):           # more than the FFN in forward
    def forward(self, x):
        return x + super().forward(x)


class Dropout(Gated):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.down(self.drop(F.relu(self.gate(x)) * self.up(x)))


class Net(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(self.norm(x))
        return self.head(x)


def _pair(*blocks, seed=0):
    torch.manual_seed(seed)
    net = Net([b() for b in blocks])
    return net, copy.deepcopy(net)


def _grads(model, out, x, allow_unused=False):
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    return torch.autograd.grad(out, [x, *model.parameters()], dy, allow_unused=allow_unused,
                               materialize_grads=allow_unused)


KINDS = [Gated, Plain, FusedMLP, RawMatmul]


def test_prepares_every_spelling_and_reports_it():
    net, _ = _pair(*KINDS)
    report = twell_compile.prepare(net)
    assert [r.layer for r in report.rewrites] == [f"blocks.{i}" for i in range(4)], str(report)
    assert [r.gated for r in report.rewrites] == [True, False, True, True]
    assert all(r.via == "prepare" and (r.k, r.n, r.k_out) == (16, 40, 16) for r in report.rewrites), str(report)
    assert not report.rejections and spec_of(net.norm) is None and spec_of(net) is None
    assert all(isinstance(b, kind) and spec_of(b) is not None for b, kind in zip(net.blocks, KINDS))
    # Preparing again changes nothing; the state dict keys are those of the original model.
    assert not twell_compile.prepare(net).rewrites
    assert list(net.state_dict()) == list(_pair(*KINDS)[0].state_dict())


@pytest.mark.parametrize("near_miss, reason", [(Silu, "SiLU"), (Leaky, "other users"), (Residual, "other than the FFN"),
                                               (Dropout, "dropout")])
def test_near_misses_are_not_prepared(near_miss, reason):
    net, _ = _pair(Gated, near_miss)
    report = twell_compile.prepare(net)
    assert [r.layer for r in report.rewrites] == ["blocks.0"], str(report)
    assert [r.layer for r in report.rejections] == ["blocks.1"] and reason in report.rejections[0].reason, str(report)
    assert spec_of(net.blocks[1]) is None and type(net.blocks[1]) is near_miss


def test_eager_prepared_model_is_exact_and_runs_the_ops():
    net, ref = _pair(*KINDS)
    twell_compile.prepare(net)
    x = torch.randn(3, 5, 16, requires_grad=True)
    twell_compile.reset_stats()
    out, want = net(x), ref(x)
    assert set(twell_compile.layer_stats()) == {f"blocks.{i}" for i in range(4)}   # our ops ran
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(_grads(net, out, x), _grads(ref, want, x)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(net(x), ref(x), atol=1e-5, rtol=1e-5)
    assert twell_compile.unprepare(net) == 4 and all(spec_of(b) is None for b in net.blocks)
    torch.testing.assert_close(net(x), want, atol=0, rtol=0)


def test_compiled_prepared_model_matches_unprepared_eager():
    net, ref = _pair(Gated, FusedMLP)
    twell_compile.prepare(net, options=REWRITE_ALL)     # K=16: on a CPU the rules would leave it
    x = torch.randn(4, 16, requires_grad=True)
    out = torch.compile(net, backend="twell")(x)
    want = ref(x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(_grads(net, out, x), _grads(ref, want, x)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    report = twell_compile.explain(net, x)
    assert [(r.layer, r.op, r.via) for r in report.rewrites] == [
        ("blocks.0", "twell::ffn_train", "prepare"), ("blocks.1", "twell::ffn_train", "prepare")], str(report)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(net, backend="twell")(x), ref(x), atol=1e-5, rtol=1e-5)
        assert [r.op for r in twell_compile.explain(net, x).rewrites] == ["twell::ffn"] * 2


def test_prepared_model_compiles_as_one_graph():
    # fullgraph: a graph break in a prepared FFN raises (torch 2.11 broke on the torch.func
    # depth query in every prepared FFN: 10 graphs for a 4-layer Llama, one frame left to eager)
    net, _ = _pair(Gated, FusedMLP)
    twell_compile.prepare(net, options=REWRITE_ALL)
    x = torch.randn(4, 16, requires_grad=True)
    torch._dynamo.reset()
    torch.compile(net, backend="twell", fullgraph=True)(x).sum().backward()
    assert all(p.grad is not None for p in net.parameters())
    with torch.no_grad():
        torch.compile(net, backend="twell", fullgraph=True)(x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_prepared_model_compiles_as_one_graph_on_cuda_in_a_fresh_process():
    """On CUDA the prepared forward asks the device's record (whose first lookup queries the
    driver) and autocast's availability: under torch 2.11 each broke the graph in every
    prepared FFN (0.71x of Inductor for a 16-layer Llama, bench_e2e.py --forward after prepare).
    A fresh process: no record cached yet."""
    import subprocess
    import textwrap

    script = textwrap.dedent("""
        import copy
        import torch, torch.nn as nn, torch.nn.functional as F
        import twell_compile

        from twell_compile.testing import GatedMLP

        torch.manual_seed(0)
        net = nn.Sequential(GatedMLP(64, 160, bias=True), GatedMLP(64, 160, bias=True)).cuda().to(torch.bfloat16)
        ref = copy.deepcopy(net)
        twell_compile.prepare(net, down_layout="transposed")
        x = torch.randn(4096, 64, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            want = ref(x).float()
            torch.testing.assert_close(torch.compile(net, backend="twell", fullgraph=True)(x).float(),
                                       want, atol=3e-2, rtol=3e-2)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                got = torch.compile(net, backend="twell", fullgraph=True)(x.float())
            torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr[-3000:]


def test_l1_is_given_to_prepare_not_to_compile():
    net, ref = _pair(Gated, Gated, Gated, seed=1)
    coef = 0.05
    twell_compile.prepare(net, options={"twell.l1": coef})
    x = torch.randn(2, 7, 16)
    hs, h_x = [], x
    for b in ref.blocks:
        xn = ref.norm(h_x)
        hs.append(F.relu(b.gate(xn)) * b.up(xn))
        h_x = h_x + b.down(hs[-1])
    (ref.head(h_x).sum() + coef * torch.stack([h.abs().mean() for h in hs]).mean()).backward()
    for run in (net, torch.compile(net, backend="twell")):
        net.zero_grad()
        run(x).sum().backward()
        for a, p in zip(ref.parameters(), net.parameters()):
            torch.testing.assert_close(p.grad, a.grad, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    with pytest.raises((ValueError, torch._dynamo.exc.BackendCompilerFailed), match="pass twell.l1 to prepare"):
        torch.compile(net, backend="twell", options={"twell.l1": coef})(x)


def test_autocast_matches_unprepared():
    net, ref = _pair(Gated, Plain)
    twell_compile.prepare(net)
    x = torch.randn(6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = net(x), ref(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_mixed_dtypes_outside_autocast_raise_as_unprepared():
    """A bf16 input into fp32 weights: F.linear raises outside autocast, so does the prepared
    module (eager and compiled), naming the layer; under autocast it runs as eager does."""
    net, ref = _pair(Gated)
    twell_compile.prepare(net)
    x = torch.randn(3, 16).bfloat16()
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="same dtype"):
            ref.blocks[0](x)
        with pytest.raises(RuntimeError, match="blocks.0: input is torch.bfloat16"):
            net.blocks[0](x)
        with pytest.raises(RuntimeError, match="dtype"):
            torch.compile(net.blocks[0], backend="twell")(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = net.blocks[0](x), ref.blocks[0](x)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_each_prepared_ffn_and_each_compile_has_its_own_instance():
    """Runtime state (the CUDA policy's measurements) is per op instance: two prepared models
    with the same layer names do not share it, nor does a new compile of the same one."""
    from tests.passes.rewrite_harness import PassBackend

    from twell_compile.ops import arg_index

    nets = [_pair(Gated, Gated)[0] for _ in range(2)]
    for net in nets:
        twell_compile.prepare(net)
    eager = [spec_of(b).instance for net in nets for b in net.blocks]
    assert len(set(eager)) == 4 and 0 not in eager
    op = torch.ops.twell.ffn.default
    compiled = []
    for _ in range(2):
        torch._dynamo.reset()
        backend = PassBackend()
        with torch.no_grad():
            torch.compile(nets[0], backend=backend)(torch.randn(2, 16))
        compiled += [n.args[arg_index(op, "instance")] for n in backend.nodes()
                     if n.op == "call_function" and n.target is op]
    assert len(compiled) == 4 and len(set(compiled + eager)) == 8, (compiled, eager)


def test_blocks_compiled_one_by_one_share_one_graph_and_run_as_their_own_layers(caplog):
    """Regional compilation (and FSDP2, whose hooks end a frame at every block) compiles each
    block's forward on one code object. The training op takes its layer from the module's tag
    tensor, not from constants, so 10 blocks compile once (constants recompiled every block, 8
    graphs, and Dynamo's limit of 8 left the rest eager), and each call still runs as its own
    layer: gradients equal the unprepared model's, statistics are kept per layer."""
    torch.manual_seed(0)
    net = nn.Sequential(*(Block(Gated()) for _ in range(10)))
    ref = copy.deepcopy(net)
    twell_compile.prepare(net, options={"twell.l1": 0.05})
    assert not any("tag" in k for k in net.state_dict())          # the tag is no buffer
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    twell_compile.reset_stats()
    for block in net:
        block.compile(backend="twell")
    x = torch.randn(3, 5, 16, requires_grad=True)    # as every later block's input: no requires_grad recompile
    with caplog.at_level("INFO", logger="twell_compile"):
        net(x).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    rewrites = [r.args[0] for r in caplog.records if r.msg.startswith("twell: rewrote")]
    assert rewrites == ["0.mlp"], rewrites                      # one graph, named after the first block
    assert sorted(twell_compile.layer_stats()) == sorted(f"{i}.mlp" for i in range(10))
    hs, h = [], x                                                 # the penalty, as the paper's mean
    for b in ref:
        xn = b.norm(h)
        hs.append(F.relu(b.mlp.gate(xn)) * b.mlp.up(xn))
        h = h + b.mlp.down(hs[-1])
    (h.sum() + 0.05 * torch.stack([v.abs().mean() for v in hs]).mean()).backward()
    for a, p in zip(ref.parameters(), net.parameters()):
        torch.testing.assert_close(p.grad, a.grad, atol=1e-5, rtol=1e-5)
    assert twell_compile.unprepare(net) == 10 and not any(hasattr(b.mlp, "_twell_tag") for b in net)


def test_prepared_model_saves_loads_and_copies_with_its_own_runtime_state(tmp_path):
    """torch.save of the whole model and deepcopy rebuild prepared modules from their original
    class (the prepared subclass is made at run time, pickle cannot find it by name), each with
    a tag of its own: same layers and results, separate runtime state."""
    import io

    from twell_compile.ops import tagged

    net, ref = _pair(Gated, Plain)
    twell_compile.prepare(net)
    buf = io.BytesIO()
    torch.save(net, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    x = torch.randn(5, 16, requires_grad=True)
    for other in (loaded, copy.deepcopy(net)):
        for a, b in zip(net.blocks, other.blocks):
            assert type(a) is type(b) and spec_of(b).layer == spec_of(a).layer
            assert spec_of(b).instance != spec_of(a).instance
            assert tagged(b._twell_tag) == (spec_of(b).instance, spec_of(a).layer)
        torch.testing.assert_close(other(x), ref(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(_grads(other, other(x), x), _grads(ref, ref(x), x), atol=1e-5, rtol=1e-5)


def test_bad_arguments_name_the_argument():
    with pytest.raises(TypeError, match="model"):
        twell_compile.prepare(lambda x: x)
    with pytest.raises(TypeError, match="options"):
        twell_compile.prepare(Gated(), options=[("twell.l1", 1.0)])
    with pytest.raises(ValueError, match="twell.nope"):
        twell_compile.prepare(Gated(), options={"twell.nope": 1})
    with pytest.raises(ValueError, match="options"):
        twell_compile.prepare(Gated(), options={"max_autotune": True})
    with pytest.raises(ValueError, match="twell.l1"):
        twell_compile.prepare(Gated(), options={"twell.l1": -1.0})
    with pytest.raises(ValueError, match="down_layout"):
        twell_compile.prepare(Gated(), down_layout="column")
    with pytest.raises(TypeError, match="model"):
        twell_compile.unprepare("model")


def test_down_layout_transposed_keeps_values_parameters_and_state_dict(tmp_path):
    """prepare(down_layout="transposed") re-stores each prepared FFN's down weight in [N, K_out]
    rows (the per-row kernels then read it without a per-call transpose): same Parameter
    objects, values, outputs, gradients, optimizer steps and state_dict as the unprepared model;
    every other parameter keeps its storage."""
    from twell_compile.runtime.launch import transposed

    net, ref = _pair(Gated, Plain, FusedMLP, RawMatmul)
    params = dict(net.named_parameters())
    report = twell_compile.prepare(net, down_layout="transposed")
    assert len(report.rewrites) == 4
    downs = {"blocks.0.down.weight", "blocks.1.fc2.weight", "blocks.2.down.weight", "blocks.3.w2"}
    for name, p in net.named_parameters():
        assert p is params[name]
        assert p.is_contiguous() == (name not in downs), name
        torch.testing.assert_close(p, dict(ref.named_parameters())[name], atol=0, rtol=0)
    for name in downs:
        w = params[name]
        assert w.stride() == (1, w.shape[0]) and transposed(w).data_ptr() == w.data_ptr()
    x = torch.randn(5, 16, requires_grad=True)
    torch.testing.assert_close(net(x), ref(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_grads(net, net(x), x), _grads(ref, ref(x), x), atol=1e-5, rtol=1e-5)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (net, ref)]
    for model, opt in zip((net, ref), opts):
        model(x.detach()).square().mean().backward()
        opt.step()
    torch.testing.assert_close(net(x), ref(x), atol=1e-5, rtol=1e-5)
    torch.save(net.state_dict(), tmp_path / "sd.pt")
    fresh, _ = _pair(Gated, Plain, FusedMLP, RawMatmul, seed=1)
    twell_compile.prepare(fresh, down_layout="transposed")
    fresh.load_state_dict(torch.load(tmp_path / "sd.pt"))
    assert not fresh.blocks[0].down.weight.is_contiguous()
    torch.testing.assert_close(fresh(x), net(x), atol=0, rtol=0)


@pytest.mark.parametrize("options, suggestion", [({"l1": 1.0}, "twell.l1"), ({"twell.l1_layer": 2}, "twell.l1_layers"),
                                                 ({"twel.ell_width": 64}, "twell.ell_width")])
def test_misspelled_options_suggest_the_twell_key(options, suggestion):
    with pytest.raises(ValueError, match=rf"did you mean '{suggestion}'\?"):
        twell_compile.prepare(Gated(), options=options)


def test_hf_llama_family_prepared_end_to_end():
    pytest.importorskip("transformers")
    from tests.models.hf_tiny import FAMILIES, VOCAB, build, main_output

    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    for name in ("llama", "phi3", "gpt2"):
        model, ref = build(name), build(name)
        report = twell_compile.prepare(model)
        layer0 = FAMILIES[name].layer
        assert [r.layer for r in report.rewrites] == [layer0, layer0.replace(".0.", ".1.")], str(report)
        with torch.no_grad():
            torch.testing.assert_close(main_output(model(ids)), main_output(ref(ids)), atol=1e-5, rtol=1e-5)
    model.train()   # GPT-2 with its resid dropout at p=0: still one FFN
    out = torch.compile(model, backend="twell")(ids)
    torch.testing.assert_close(main_output(out), main_output(ref.train()(ids)), atol=1e-5, rtol=1e-5)


def test_model_that_is_one_ffn_is_prepared_as_root():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 8))
    ref = copy.deepcopy(model)
    report = twell_compile.prepare(model)
    assert [(r.layer, r.gated) for r in report.rewrites] == [("root", False)], str(report)
    x = torch.randn(5, 8)
    torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ torch.func transforms
def _fwd_ad(net, x, t):
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        out = fwAD.unpack_dual(net(fwAD.make_dual(x, t)))
        return out.primal, out.tangent


PREPARED_TRANSFORMS = {
    "grad": lambda net, x, t: torch.func.grad(lambda x: net(x).sum())(x),
    "grad_params": lambda net, x, t: tuple(torch.func.grad(
        lambda p: torch.func.functional_call(net, p, (x,)).square().sum())(
            {k: v.detach() for k, v in net.named_parameters()}).values()),
    "jacrev": lambda net, x, t: torch.func.jacrev(net)(x),
    "jvp": lambda net, x, t: torch.func.jvp(net, (x,), (t,)),
    "vmap": lambda net, x, t: torch.func.vmap(net)(x.unsqueeze(1)),
    "forward_ad": _fwd_ad,
}


@pytest.mark.parametrize("name", list(PREPARED_TRANSFORMS))
def test_prepared_modules_under_torch_func_run_their_original_forward(name, caplog):
    """torch.func.grad/jacrev over a prepared model failed (the op's autograd formula does not
    support functorch), jvp gave wrong tangents: under any torch.func transform or with a dual
    input a prepared module runs its original forward, says so once in the log, and takes
    its op again afterwards."""
    from tests.passes.rewrite_harness import check_close
    sys.modules["twell_compile.prepare"].reset_fallback_log()   # (the package's ``prepare`` is the function)
    net, ref = _pair(Gated, FusedMLP, Plain)
    twell_compile.prepare(net)
    x, t = torch.randn(3, 16), torch.randn(3, 16)
    with caplog.at_level("WARNING", logger="twell_compile"):
        calls, (got, got_again) = twell_op_calls(lambda: [PREPARED_TRANSFORMS[name](net, x, t) for _ in range(2)])
    want = PREPARED_TRANSFORMS[name](ref, x, t)
    assert not calls
    got, got_again, want = ((v if isinstance(v, tuple) else (v,)) for v in (got, got_again, want))
    for a, b, c in zip(got, got_again, want, strict=True):
        check_close(name, a, c)
        assert torch.equal(a, b)
    fell_back = [r for r in caplog.records if "original forward" in r.getMessage()]
    assert len(fell_back) == 1, [r.getMessage() for r in caplog.records]
    assert len(twell_op_calls(lambda: net(x))[0]) == 3      # outside the transform: the ops again


def test_prepared_vmap_in_grad_mode_trains_the_weights():
    from tests.passes.rewrite_harness import check_close

    net, ref = _pair(Gated, FusedMLP)
    twell_compile.prepare(net)
    x = torch.randn(4, 2, 16)
    dy = torch.randn(4, 2, 4)
    for model in (net, ref):
        torch.func.vmap(model)(x).backward(dy)
    for (name, a), b in zip(net.named_parameters(), ref.parameters(), strict=True):
        assert a.grad is not None, name
        check_close(f"grad {name}", a.grad, b.grad)


class OneBias(Gated):
    """Biases of shape [1] (F.linear broadcasts them)."""

    def __init__(self):
        super().__init__()
        for lin in (self.gate, self.up, self.down):
            lin.bias = nn.Parameter(torch.randn(1))


def test_broadcast_bias_is_prepared_and_trains():
    from tests.passes.rewrite_harness import check_close

    net, ref = _pair(OneBias)
    report = twell_compile.prepare(net)
    assert [r.layer for r in report.rewrites] == ["blocks.0"], str(report)
    x = torch.randn(5, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    got, want = net(x), ref(x_ref)
    check_close("output", got, want)
    g_got, g_want = _grads(net, got, x), _grads(ref, want, x_ref)
    for name, a, b in zip(["x"] + [n for n, _ in net.named_parameters()], g_got, g_want, strict=True):
        assert a.shape == b.shape, name
        check_close(f"grad {name}", a, b)


# ------------------------------------------------------------------------------ what forward reads
class Switchable(nn.Module):
    """A forward that reads a Python flag and an activation submodule (the decision rests on both)."""

    def __init__(self, k=16, n=40):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(k, n), nn.Linear(k, n), nn.Linear(n, k)
        self.gated = True
        self.act = nn.ReLU()

    def forward(self, hidden_states):
        h = self.act(self.gate(hidden_states))
        h = h * self.up(hidden_states) if self.gated else h
        return self.down(h)


def _ran_op(fn, *args, **kwargs):
    """fn's result and whether a twell op ran in it (the profiler records dispatched ops)."""
    with torch.profiler.profile() as prof:
        out = fn(*args, **kwargs)
    return out, any(e.name.startswith("twell::") for e in prof.events())


# (attribute, new value, whether the FFN is still a ReLU FFN after the change)
CHANGES = [("gated", False, True), ("act", nn.GELU(), False), ("act", nn.ReLU(inplace=True), True),
           ("act", nn.ReLU(), True), ("gated", True, True)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_prepared_module_follows_what_its_forward_reads(compiled, grad, caplog):
    """A prepared module computed the FFN it saw at prepare time after ``m.gated = False`` or
    ``m.act = nn.GELU()`` (57-125% of max|y| off): each change is seen by the next call, eager
    (decided again) and compiled (Dynamo guards on the reads; the original forward is traced)."""
    from tests.passes.rewrite_harness import check_close

    torch.manual_seed(3)
    m = Switchable()
    ref = copy.deepcopy(m)
    twell_compile.prepare(m, options=REWRITE_ALL)
    run = torch.compile(m, backend="twell", options=REWRITE_ALL) if compiled else m
    x = torch.randn(3, 5, 16, requires_grad=grad)
    with torch.set_grad_enabled(grad), caplog.at_level("INFO", logger="twell_compile"):
        for attr, value, relu_ffn in [(None, None, True)] + CHANGES:
            if attr is not None:
                setattr(m, attr, value)
                setattr(ref, attr, copy.deepcopy(value))
            got, ran = _ran_op(run, x)
            want = ref(x)
            check_close(f"after {attr}={value}", got, want)
            if grad:
                for a, b in zip(_grads(m, got, x, True), _grads(ref, want, x, True), strict=True):
                    check_close(f"grad after {attr}={value}", a, b)
            # the op runs exactly while the forward is a ReLU FFN (compiled: the backend's rewrite)
            assert ran == relu_ffn, (attr, value)
    if not compiled:
        said = [r.getMessage() for r in caplog.records]
        assert any("act changed since it was prepared" in s and "GELU" in s for s in said), said


class DataDependent(nn.Module):
    """An activation torch.fx cannot trace (control flow on a tensor's value)."""

    def forward(self, x):
        return F.relu(x) if bool(x.sum() > 0) else x


@pytest.mark.parametrize("act", [nn.SiLU, DataDependent])
def test_prepared_module_that_changed_and_was_changed_back_takes_its_op_again(act, caplog):
    m = Switchable()
    ref = copy.deepcopy(m)
    twell_compile.prepare(m, options=REWRITE_ALL)
    x = torch.randn(4, 16)
    with torch.no_grad(), caplog.at_level("INFO", logger="twell_compile"):
        m.act, ref.act = act(), act()
        assert not _ran_op(m, x)[1]
        assert not _ran_op(m, x)[1]
        # the decision is kept: one trace, said once, not one per call
        assert sum("act changed" in r.getMessage() for r in caplog.records) == 1
        torch.testing.assert_close(m(x), ref(x))
        m.act = nn.ReLU()
        assert _ran_op(m, x)[1]
    assert spec_of(m).up is not None


class Keyword(Gated):
    def forward(self, hidden_states):
        return super().forward(hidden_states)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_prepared_module_takes_its_forwards_keyword(compiled):
    """``m(hidden_states=x)`` raised TypeError from the prepared forward."""
    torch.manual_seed(0)
    m = Keyword()
    ref = copy.deepcopy(m)
    twell_compile.prepare(m, options=REWRITE_ALL)
    run = torch.compile(m, backend="twell", options=REWRITE_ALL) if compiled else m
    x = torch.randn(2, 16)
    with torch.no_grad():
        got, ran = _ran_op(run, hidden_states=x)
        torch.testing.assert_close(got, ref(x), atol=1e-5, rtol=1e-5)
        assert ran
        # a keyword the forward does not take fails as it does unprepared
        with pytest.raises(TypeError, match="unexpected keyword argument 'x'"):
            ref(x=x)
        with pytest.raises(TypeError, match="unexpected keyword argument 'x'"):
            m(x=x)


@pytest.mark.parametrize("l1", [None, 0.5])
def test_prepared_ffn_of_width_zero_behaves_as_eager(l1):
    m = Gated(n=0)                 # a gated FFN pruned to no hidden unit
    ref = copy.deepcopy(m)
    twell_compile.prepare(m, options={**REWRITE_ALL, **({"twell.l1": l1} if l1 else {})})
    assert spec_of(m) is not None
    x = torch.randn(3, 16, requires_grad=True)
    got, want = m(x), ref(x)
    torch.testing.assert_close(got, want)
    for a, b in zip(_grads(m, got, x), _grads(ref, want, x), strict=True):
        torch.testing.assert_close(a, b)


def test_prepare_under_a_default_device_keeps_its_tag_on_the_cpu():
    """The tag was made on the default device: under ``with torch.device("meta")`` (models built
    without memory) the training op then refused it, a CPU tensor being required."""
    with torch.device("meta"):
        m = Gated()
        twell_compile.prepare(m, options=REWRITE_ALL)
        y = m(torch.randn(2, 16, requires_grad=True))
    assert y.shape == (2, 16) and y.device.type == "meta"
