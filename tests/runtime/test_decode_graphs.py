"""runtime/decode_graphs.py: eager decode calls of the op replayed from its own CUDA graphs.

GPU tests (marker ``gpu``): fresh inputs every call checked against fp32 with the 2x rule,
outputs poisoned-free and never aliased across calls, one graph per key, in-place weight
updates seen by replays, nothing captured while the caller captures, the switch, nothing left
in Inductor's cudagraph pool by a capture inside a reduce-overhead recompile's warm-up. CPU:
the module never engages for CPU tensors."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ffn_args as _args, poison as _poison, rel as _rel
from twell_compile.testing import GatedMLP, PlusMean
from tests.helpers import ffn_with_biases
from tests.runtime.test_cuda_decode import MECHANISM, gpu
from tests.runtime.test_cuda_decode import decode_wins_everywhere  # noqa: F401  (a fixture)
from twell_compile.runtime import arch, decode_graphs, decode_state as ds, density


def test_not_usable_on_cpu():
    assert not decode_graphs.usable(torch.zeros(2, 3))


def _taken(k, xa, ya):
    """KeyGraphs.choose, holding what it captures (a stand-in object for the graph)."""
    capture, vk = k.choose(xa, ya)
    if capture:
        assert vk not in k.variants
        k.variants[vk] = object()
    return ("capture" if capture else "replay"), vk


def test_a_key_binds_the_addresses_that_repeat_and_copies_otherwise():
    """The variant choice of one key (CPU): the first call's addresses are remembered; a
    repeat of x's and y's captures a graph binding both, replayed while they repeat; a y at a
    new address (the caller kept the last) takes a graph binding x alone; at most MAX_BOUND
    binding graphs, then the copying one; a call that binds nothing copies."""
    A, B, C = (10, (4, 1)), (20, (4, 1)), (30, (4, 1))
    k = decode_graphs.KeyGraphs()
    k.first(A, 100)
    assert _taken(k, A, 100) == ("capture", (A, 100))
    assert _taken(k, A, 100) == ("replay", (A, 100))
    assert _taken(k, A, 200) == ("capture", (A, None))        # y kept by the caller: x bound alone
    assert _taken(k, A, 300) == ("replay", (A, None))
    assert k.bound == decode_graphs.MAX_BOUND == 2
    assert _taken(k, B, 300) == ("capture", (None, None))     # nothing repeats: the copying graph
    assert _taken(k, B, 300) == ("replay", (None, None))      # both repeat, but MAX_BOUND bind already
    assert _taken(k, C, 400) == ("replay", (None, None))
    assert _taken(k, A, 500) == ("replay", (A, None))
    assert len(k.variants) == 3


def test_a_key_without_addresses_to_bind_keeps_one_copying_graph():
    k = decode_graphs.KeyGraphs()
    k.first(None, None)
    assert _taken(k, None, None) == ("capture", (None, None))
    for _ in range(3):
        assert _taken(k, None, None) == ("replay", (None, None))
    assert k.bound == 0 and len(k.variants) == 1


def test_a_y_address_that_repeats_alone_binds_y():
    """x at a new address each call (copied), y's block handed back each call: y bound alone."""
    k = decode_graphs.KeyGraphs()
    k.first((1, (8, 1)), 700)
    assert _taken(k, (2, (8, 1)), 700) == ("capture", (None, 700))
    assert _taken(k, (3, (8, 1)), 700) == ("replay", (None, 700))
    assert _taken(k, (4, (8, 1)), 800) == ("capture", (None, None))


def test_the_switch_is_scoped_and_restored():
    was = decode_graphs.ENABLED
    with decode_graphs.enabled(False):
        assert decode_graphs.ENABLED is False
        with decode_graphs.enabled(True):
            assert decode_graphs.ENABLED is True
        assert decode_graphs.ENABLED is False
    assert decode_graphs.ENABLED == was
    with pytest.raises(KeyError), decode_graphs.enabled(not was):
        raise KeyError
    assert decode_graphs.ENABLED == was


@pytest.fixture
def decode_op():
    """Clean state; the op then runs forced to one decode form per M (``_decode``)."""
    density.reset()
    decode_graphs.clear()
    ds.clear()
    with arch.patched(**MECHANISM):
        yield
    decode_graphs.clear()
    ds.clear()
    density.reset()


def _decode(args, layer):
    """The op on the decode path, one form per M (no switch when a density lands)."""
    m = args[0].shape[0]
    return torch.ops.twell.ffn(*args, layer, False, 0, "decode-rows" if m <= 4 else "decode-pairs")


def _ref(args):
    from twell_compile.reference import ffn_dense
    ref = ffn_dense(*(None if a is None else a.float() for a in args))
    return ref, _rel(ffn_dense(*args), ref)


@gpu
@pytest.mark.parametrize("m", [1, 16])
def test_eager_calls_replay_one_graph_and_never_alias(decode_op, m):
    p = ffn_with_biases(m, 2048, 5632, 2048, 0.005, dtype=torch.bfloat16)
    assert ds.register(p["w_down"])
    outs, refs = [], []
    for i in range(5):
        p["x"] = torch.randn_like(p["x"]) * (1 + i)
        p["x"][:, 0] = 1.0
        args = _args(p)
        _poison()
        y = _decode(args, f"graphs{m}")
        ref, derr = _ref(args)
        assert torch.isfinite(y).all()
        assert _rel(y, ref) <= 2 * derr + 1e-6, i
        outs.append(y)
        refs.append((ref, derr))
        # first call eager, second captures, later ones replay the same graph
        assert decode_graphs.count() == (0 if i == 0 else 1)
    torch.cuda.synchronize()
    for y, (ref, derr) in zip(outs, refs):          # earlier outputs untouched by later calls
        assert _rel(y, ref) <= 2 * derr + 1e-6


@gpu
def test_graph_captured_under_inference_mode_replays_outside_it(decode_op):
    """The graph's input buffer is copied into at every replay: made under inference_mode it
    would be an inference tensor, and a later call outside inference mode would fail."""
    p = ffn_with_biases(4, 2048, 5632, 2048, 0.005, dtype=torch.bfloat16)
    assert ds.register(p["w_down"])
    with torch.inference_mode():
        for _ in range(2):                   # eager, then captured
            _decode(_args(p), "graphs_inf")
    assert decode_graphs.count() == 1
    args = _args(p)
    ref, derr = _ref(args)
    with torch.no_grad():
        y = _decode(args, "graphs_inf")      # replayed outside inference mode
    assert _rel(y, ref) <= 2 * derr + 1e-6


@gpu
def test_replays_see_in_place_weight_updates(decode_op):
    p = ffn_with_biases(4, 2048, 5632, 2048, 0.005, dtype=torch.bfloat16)
    assert ds.register(p["w_down"])
    for _ in range(3):
        _decode(_args(p), "graphs_upd")
    assert decode_graphs.count() == 1
    with torch.no_grad():
        p["w_up"].mul_(-1.5)
        p["w_down"].add_(torch.randn_like(p["w_down"]) * 0.05)
        p["b_down"].add_(1.0)
    y = _decode(_args(p), "graphs_upd")
    assert decode_graphs.count() == 1                # same pointers: the same graph replayed
    ref, derr = _ref(_args(p))
    assert _rel(y, ref) <= 2 * derr + 1e-6


@gpu
def test_no_graph_of_its_own_while_the_caller_captures(decode_op):
    p = ffn_with_biases(8, 2048, 5632, 2048, 0.005, dtype=torch.bfloat16)
    assert ds.register(p["w_down"])
    x = p["x"].clone()
    args = (x,) + _args(p)[1:]
    _decode(args, "graphs_cap")     # warm-up (compiles)
    outer = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        outer.capture_begin()
        out = _decode(args, "graphs_cap")
        outer.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    assert decode_graphs.count() == 0
    for i in range(3):
        x.copy_(torch.randn_like(x) * (i + 1))
        x[:, 0] = 1.0
        out.fill_(float("nan"))
        outer.replay()
        ref, derr = _ref(args)
        assert _rel(out, ref) <= 2 * derr + 1e-6


@gpu
@pytest.mark.parametrize("case", ["switched_off", "unregistered_weight"])
def test_no_graph(decode_op, case):
    """Graphs switched off (decode_graphs.enabled(False), as TWELL_DECODE_GRAPHS=0 at import),
    or a W_down the weight cache does not hold: eager calls."""
    p = ffn_with_biases(2, 2048, 5632, 2048, 0.005, dtype=torch.bfloat16)
    if case == "switched_off":
        assert ds.register(p["w_down"])
    with decode_graphs.enabled(case != "switched_off"):
        for _ in range(3):
            y = _decode(_args(p), f"graphs_{case}")
    assert decode_graphs.count() == 0
    ref, derr = _ref(_args(p))
    assert _rel(y, ref) <= 2 * derr + 1e-6


@gpu
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("path", ["auto", "dense"])
def test_dense_path_at_decode_sizes_is_graphed(gated, path):
    """Where the rule runs dense at M <= decode_max_m (no statistics; here: a decode margin of
    0, so decode never wins), or dense is forced, eager's GEMMs replay from one graph per key
    too; results within the 2x rule of fp32 on fresh inputs."""
    decode_graphs.clear()
    p = ffn_with_biases(64, 2048, 5632, 2048, 0.02, dtype=torch.bfloat16, gated=gated)
    for i in range(4):
        p["x"] = torch.randn_like(p["x"])
        _poison()
        with arch.patched(decode_margin=0.0):
            y = torch.ops.twell.ffn(*_args(p), "graphs_dense", False, 0, path)
        ref, derr = _ref(_args(p))
        assert _rel(y, ref) <= 2 * derr + 1e-6, i
        assert decode_graphs.count() == (0 if i == 0 else 1)
    decode_graphs.clear()


@pytest.mark.parametrize("flag", ["allow_tf32", "allow_bf16_reduced_precision_reduction",
                                  "allow_fp16_reduced_precision_reduction", "allow_fp16_accumulation"])
def test_every_cublas_setting_is_part_of_the_graph_key(flag):
    """A graph keeps the cuBLAS settings of its capture: changing any flag of
    torch.backends.cuda.matmul gives another key.
    The flags are properties of torch's cuBLAS module, set and restored by hand (monkeypatch's
    undo deletes them on pytest 9.2, which raises AttributeError)."""
    m = torch.backends.cuda.matmul
    getter = {"allow_bf16_reduced_precision_reduction": "_get_cublas_allow_bf16_reduced_precision_reduction",
              "allow_fp16_reduced_precision_reduction": "_get_cublas_allow_fp16_reduced_precision_reduction"}
    old = getattr(torch._C, getter[flag])() if flag in getter else getattr(m, flag)
    precision = m.fp32_precision          # setting allow_tf32 sets it too
    before = decode_graphs.math_mode()
    try:
        setattr(m, flag, not getattr(m, flag))
        assert decode_graphs.math_mode() != before
    finally:
        setattr(m, flag, old)
        m.fp32_precision = precision
    assert decode_graphs.math_mode() == before


@gpu
def test_autocast_is_part_of_the_graph_key():
    before = decode_graphs.math_mode()
    with torch.autocast("cuda", dtype=torch.float16, enabled=True):
        assert decode_graphs.math_mode() != before
    assert decode_graphs.math_mode() == before


@gpu
def test_recompile_warmup_leaves_nothing_in_the_cudagraph_pool(decode_wins_everywhere):
    """The op's own graph is captured at a key's second eager call. When that call is a
    recompiled graph's warm-up (as a generate() step after a new cache length), the graph's
    input buffer must not come from Inductor's pool: its check then fails with "Detected 16
    tensor(s) in the cudagraph pool not tracked as outputs" (H200, 2026-11-23). The FFN sits
    next to an input whose length changes (PlusMean's z): a new length recompiles, and under
    reduce-overhead the new graph's first run is a warm-up inside the cudagraph tree's pool."""
    from twell_compile.reference import ffn_dense
    density.reset()
    ds.clear()
    decode_graphs.clear()
    model = GatedMLP.at_density(512, 1408, 0.01).cuda().to(torch.bfloat16)
    f = torch.compile(PlusMean(model), backend="twell", dynamic=False,
                      options={"twell.mode": "reduce-overhead", "twell.path": "decode-rows"})
    w = (model.gate.weight, None, model.up.weight, None, model.down.weight, None)
    with torch.no_grad():
        for i, zlen in enumerate((3, 3, 3, 5, 5, 5)):
            x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16) * (1 + i)
            x[:, 0] = 1.0
            z = torch.randn(zlen, device="cuda")
            y = f(x, z).clone()
            ref = ffn_dense(*(None if t is None else t.float() for t in (x,) + w)) + z.mean()
            # eager's error on the same step: the bf16 FFN, then the sum rounded to bf16 as well
            derr = _rel(ffn_dense(x, *w) + z.mean(), ref)
            assert _rel(y, ref) <= 2 * derr + 1e-6, (i, zlen)
    assert decode_graphs.count() == 1, "the recompile's warm-up did not capture the op's graph"
    decode_graphs.clear()
    ds.clear()
