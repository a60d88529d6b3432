"""GPU tests of the CUDA training path (runtime/cuda_train.py): gradients of twell::ffn_train
through autograd on every path (sparse kernels, dense saving g and u, dense saving the compact
state; forced through the op's ``path`` argument) against fp32 autograd with
the 2x-of-bf16-eager rule, over densities 0..1, long tails, odd shapes, biases, L1, rows past
the dense backup, NaN/Inf, M up to 131072; CUDA-graph capture (no host sync); bf16 autocast
with fp32 weights and HF gradient checkpointing under torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import twell_compile  # noqa: F401
import twell_compile.ops  # noqa: F401
from tests.helpers import ARG_NAMES as NAMES, ffn_with_biases, last_paths, poison, rel as _plain_rel, twell_op_calls
from twell_compile.testing import GatedMLP
from twell_compile.formats import backup_capacity
from twell_compile.reference import activate
from twell_compile.runtime import arch, cuda_train, density, paths, select

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh():
    """Clean state; the auto plan's sparse kernels from any token count (the rules' tests)."""
    density.reset()
    cuda_train.clear_hints()
    with arch.patched(train_min_tokens=1, train_min_width=1):
        yield
    density.reset()



def test_lists_past_the_32_bit_entry_codes_train_dense_and_refuse_the_forced_sparse_path():
    """M x pow2(W) at MAX_LIST_SLOTS: "auto" leaves the sparse path at a measured low density (the
    sparse backward codes entries in 32 bits), path="twell" says why; one token fewer fits."""
    k, n, width = 64, 512, 256
    m = paths.MAX_LIST_SLOTS // width
    x = torch.zeros(1, k, device="cuda", dtype=torch.bfloat16).expand(m, k)     # the plan reads shapes only
    key = ("train", "big", x.device, x.dtype, k, n, k, True)
    density.submit(key, torch.tensor(float(m), device="cuda"), m * n)           # one unit per row
    density.submit(("train-lost",) + key[1:], torch.tensor(0.0, device="cuda"), 1)
    torch.cuda.synchronize()
    assert select.plan_train(x, n, k, True, width, 16, "big").path in ("dense", "compact")   # (the record's compact_max_lost)
    with pytest.raises(ValueError, match="32-bit entry codes .*twell.ell_width"):
        select.plan_train(x, n, k, True, width, 16, "big", path="twell")
    assert select.plan_train(x[: m - 1], n, k, True, width, 16, "big").path == "twell"


def _path(x, wg, wd, layer):
    """The path the layer's last call took (select.plan_train's choice, recorded per key)."""
    return density.last_path(("train", layer, x.device, x.dtype, x.shape[-1], wg.shape[0], wd.shape[0], True))


def _ffn(m, k, n, k_out, density, tail, gated=True, bias=True, seed=0, dtype=torch.bfloat16):
    p = ffn_with_biases(m, k, n, k_out, density, tail, dtype=dtype, gated=gated, bias=bias, seed=seed, down_floor=1e-2)
    return [p[a] for a in NAMES]


class _no_tf32:
    """fp32 references in full fp32 (TF32 off), restored afterwards."""

    def __enter__(self):
        self.old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.old


def _rel(a, b):
    return _plain_rel(a, b, finite_only=True)


def _dense_grads(args, dy, l1, dtype, act="relu"):
    leaves = [None if a is None else a.detach().to(dtype).requires_grad_() for a in args]
    x, wg, bg, wu, bu, wd, bd = leaves
    h = activate(torch.relu(F.linear(x, wg, bg)), F.linear(x, wu, bu) if wu is not None else None, act)
    y = F.linear(h, wd, bd)
    loss = (y.float() * dy.float()).sum() + l1 * h.float().abs().mean()
    params = [a for a in leaves if a is not None]
    return y.detach(), torch.autograd.grad(loss, params)


def _twell_grads(args, dy, l1, width, backup_rows, path="auto", calls=2, act="relu"):
    for _ in range(calls):        # auto: the first call probes the density (dense path)
        leaves = [None if a is None else a.detach().requires_grad_() for a in args]
        y = torch.ops.twell.ffn_train(*leaves, width, backup_rows, l1, "t", True, 0, path, act=act)[0]
        params = [a for a in leaves if a is not None]
        grads = torch.autograd.grad((y.float() * dy.float()).sum(), params)
        torch.cuda.synchronize()
    return y.detach(), grads


def _check(args, l1=0.0, width=256, backup_rows=16, seed=0, path="twell", act="relu"):
    m, k_out = args[0].shape[0], args[5].shape[0]
    dy = torch.randn(m, k_out, device="cuda", generator=torch.Generator("cuda").manual_seed(seed + 7)).to(args[0].dtype)
    with _no_tf32():
        yref, gref = _dense_grads(args, dy, l1, torch.float32, act)
    yeag, geag = _dense_grads(args, dy, l1, args[0].dtype, act)
    poison(1024)
    y, grads = _twell_grads(args, dy, l1, width, backup_rows, path, act=act)
    assert torch.equal(torch.isnan(y), torch.isnan(yeag))
    e, d = _rel(y, yref), _rel(yeag, yref)
    assert e <= 2 * d + 1e-6, ("y", e, d)
    names = [nm for nm, a in zip(NAMES, args) if a is not None]
    for nm, g, r, ge in zip(names, grads, gref, geag):
        assert g.dtype == ge.dtype and g.shape == ge.shape, nm
        assert torch.equal(torch.isnan(g), torch.isnan(ge)), (nm, int(torch.isnan(g).sum()), int(torch.isnan(ge).sum()))
        e, d = _rel(g, r), _rel(ge, r)
        assert e <= 2 * d + 1e-6, (nm, e, d)


@pytest.mark.parametrize("path", ["twell", "dense", "compact"])
@pytest.mark.parametrize("d,tail", [(0.0, 0.0), (0.005, 0.0), (0.02, 0.2), (0.05, 0.2), (1.0, 0.0)])
@pytest.mark.parametrize("gated,bias", [(True, True), (False, False)])
def test_gradient_grid(path, d, tail, gated, bias):
    args = _ffn(1500, 520, 1100, 264, d, tail, gated, bias, seed=int(d * 1000) + gated)
    _check(args, width=64, backup_rows=8, path=path)


@pytest.mark.parametrize("path", ["twell", "dense", "compact"])
@pytest.mark.parametrize("act, gated", [("relu2", True), ("relu2", False), ("drelu", True)])
@pytest.mark.parametrize("d,tail", [(0.005, 0.0), (0.05, 0.2), (1.0, 0.0)])
def test_activation_gradient_grid(path, act, gated, d, tail):
    """Squared ReLU and dReLU on every training path: the activation's derivative from the
    saved relu(g) and u, rows over the ELL width and past the backup, the L1 penalty on the h
    fed to down (fp16 too: the square's range)."""
    args = _ffn(1500, 520, 1100, 264, d, tail, gated, True, seed=int(d * 1000) + 11)
    _check(args, width=64, backup_rows=8, path=path, act=act)
    _check(_ffn(777, 256, 700, 256, 0.03, 0.2, gated, True, seed=5, dtype=torch.float16), l1=3.0, width=32,
           backup_rows=16, path=path, act=act)


@pytest.mark.parametrize("path", ["twell", "dense", "compact"])
def test_l1_and_fp16(path):
    args = _ffn(777, 256, 700, 256, 0.03, 0.2, True, True, seed=3, dtype=torch.float16)
    _check(args, l1=3.0, width=32, backup_rows=16, path=path)


@pytest.mark.parametrize("m", [1, 2, 37])
def test_tiny_m(m):
    """Any M: the auto plan (sparse wherever the backup is smaller than M) is exact."""
    with arch.patched(sparse_max_density=float("inf")):
        _check(_ffn(m, 128, 300, 96, 0.05, 0.0, seed=m), width=8, backup_rows=16, path="auto")


def test_forced_sparse_refuses_a_backup_as_large_as_m():
    args = _ffn(2, 128, 300, 96, 0.05, 0.0, seed=1)
    with pytest.raises(ValueError, match="dense backup"):
        torch.ops.twell.ffn_train(*args, 8, 16, 0.0, "t", False, 0, "twell")


@pytest.mark.parametrize("chunk,per_sm", [(16, 1), (128, 8)])
def test_hot_neurons_lists_split_over_programs(chunk, per_sm):
    """Trained layers are skewed: 8 neurons here fire on ~70% of 4096 tokens among quiet ones.
    Their wgrad lists split into chunks (~180 of 16 entries each at chunk 16; at the shipped
    sizes, chunks of twice the mean list) that add their sums atomically, with few persistent
    programs looping over many chunks; gradients as exact."""
    args = _ffn(4096, 512, 1024, 512, 0.01, 0.0, seed=5)
    g = F.linear(args[0], args[1], args[2]).float()
    args[2] = (args[2].float() - torch.cat([g[:, :8].quantile(0.3, dim=0), g.new_zeros(g.shape[1] - 8)])).to(args[2].dtype)
    fire = (F.linear(args[0], args[1], args[2]) > 0).sum(0)
    assert int(fire[:8].min()) > 2000 and float(fire[8:].float().mean()) < 100, fire[:12]
    with arch.patched(wg_chunk=chunk, wg_programs_per_sm=per_sm, wg_chunk_over_mean=0 if chunk < 128 else 2):
        _check(args, width=64, backup_rows=16, path="twell")


@pytest.mark.parametrize("path", ["twell", "compact"])
def test_rows_past_the_backup_are_recomputed(path):
    """ELL width 4 and a backup of M/256 rows: most busy rows go to the exact recompute (per
    neuron in the sparse backward, per row in the densifying one)."""
    args = _ffn(2048, 384, 900, 384, 0.02, 0.3, seed=11)
    st = cuda_train.forward_sparse(*[a.contiguous() if a is not None else None for a in args],
                                   4, int(backup_capacity(2048, 256)))
    assert int(st[-1]) > 1000                               # rows past the backup
    _check(args, width=4, backup_rows=256, path=path)


def test_policy_follows_density_and_rows_past_the_backup():
    """The shipped rule (train_min_tokens lowered by the fixture): a layer starts dense, goes
    sparse once a low density lands, turns dense one call after its density rises (a probe
    every call), and turns dense at low density when rows overflow the backup (lost_row_pairs)."""
    def run(args, width, backup_rows, layer):
        x, wg, bg, wu, bu, wd, bd = args
        out = torch.ops.twell.ffn_train(x, wg, bg, wu, bu, wd, bd, width, backup_rows, 0.0, layer, False)
        torch.cuda.synchronize()                  # lets the probe land before the next call
        path = _path(x, wg, wd, layer)
        sparse = path == "twell"
        assert (out[5].shape[0] < x.shape[0]) == (path in ("twell", "compact"))   # the saved backup says so
        return sparse, out

    low = _ffn(4096, 256, 1024, 256, 0.004, 0.0, seed=21)
    assert run(low, 64, 16, "pol")[0] is False   # nothing measured yet: dense
    assert run(low, 64, 16, "pol")[0] is True
    d = density.measured(("train", "pol", low[0].device, low[0].dtype, 256, 1024, 256, True))
    assert d < arch.cuda_default().sparse_max_density
    # the gate bias raised (as training moves it): dense from the call after it lands
    busy = list(low)
    busy[2] = low[2] + 3.0
    assert run(busy, 64, 16, "pol")[0] is True   # decided on the density measured before
    assert run(busy, 64, 16, "pol")[0] is False
    # low density, but ELL width 2 and a 2-row backup: ~all busy rows are past it
    for _ in range(2):
        sparse, out = run(low, 2, 4096, "lost")
    assert sparse is False


def test_deterministic_mode_takes_eagers_path_with_repeatable_gradients():
    """torch.use_deterministic_algorithms(True): a layer that would run sparse (its low density
    has landed) runs the dense path saving g and u (no atomics), and two identical steps give
    the same bits, within the 2x error rule."""
    args = _ffn(2048, 256, 1024, 256, 0.004, 0.0, seed=41)
    m, k_out = args[0].shape[0], args[5].shape[0]
    dy = torch.randn(m, k_out, device="cuda", generator=torch.Generator("cuda").manual_seed(5)).to(args[0].dtype)
    _twell_grads(args, dy, 0.0, 64, 16)
    assert _path(args[0], args[1], args[5], "t") == "twell"      # the setup: sparse without the mode
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        runs = [_twell_grads(args, dy, 0.0, 64, 16, calls=1) for _ in range(2)]
        assert _path(args[0], args[1], args[5], "t") == "dense"
    finally:
        torch.use_deterministic_algorithms(was)
    (y1, g1), (y2, g2) = runs
    assert torch.equal(y1, y2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    with _no_tf32():
        yref, gref = _dense_grads(args, dy, 0.0, torch.float32)
    yeag, geag = _dense_grads(args, dy, 0.0, args[0].dtype)
    assert _rel(y1, yref) <= 2 * _rel(yeag, yref) + 1e-6
    for g, r, ge in zip(g1, gref, geag):
        assert _rel(g, r) <= 2 * _rel(ge, r) + 1e-6


def test_nan_inf_propagate_like_dense():
    args = _ffn(600, 256, 500, 256, 0.02, 0.0, seed=5)
    args[0][3, 7] = float("nan")
    args[0][10, 0] = float("inf")
    _check(args, width=16, backup_rows=64)


def test_long_m_131072():
    _check(_ffn(131072, 256, 512, 128, 0.01, 0.2, seed=2), width=32, backup_rows=16)


def test_sparse_path_is_graph_capturable():
    """No host sync in the sparse forward + backward: the whole step captures in a CUDA graph."""
    args = [a.contiguous() if a is not None else None for a in _ffn(2048, 256, 640, 256, 0.02, 0.2, seed=9)]
    dy = torch.randn(2048, 256, device="cuda", dtype=args[0].dtype)
    cap = int(backup_capacity(2048, 16))

    def step():
        y, hsum, *st, missing = cuda_train.forward_sparse(*args, 64, cap)
        grads = cuda_train.backward_sparse(dy, *args[:6], *st, 1e-6)
        return y, grads

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        want = step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        if a is not None:
            assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)


def _ours(fn):
    """(the twell ops ``fn()`` ran, by name; the paths the layers' training calls took; what
    ``fn`` returned): from the profiler's record and the runtime's per-layer record."""
    density.reset()
    calls, out = twell_op_calls(fn)
    return calls, set().union(*last_paths(training=True).values()), out


def test_autocast_fp32_weights():
    torch.manual_seed(0)
    model = GatedMLP(256, 704, bias=True).cuda()
    with torch.no_grad():
        model.gate.bias -= 0.8
    x = torch.randn(4, 512, 256, device="cuda")
    dy = torch.randn(4, 512, 256, device="cuda")

    def grads(fn, autocast=True):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = fn(x)
        (y.float() * dy).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    # the sparse kernels forced (2048 static tokens without L1 would be left to Inductor)
    compiled = torch.compile(model, backend="twell", options={"twell.path": "twell"})
    grads(compiled)
    torch.cuda.synchronize()
    calls, paths, got = _ours(lambda: grads(compiled))
    # the sparse forward, and so the sparse backward (a "twell" state's: cuda_train.backward_path)
    assert "twell::ffn_train" in calls and "twell::ffn_train_bwd" in calls and paths == {"twell"}, (calls, paths)
    with _no_tf32():
        ref = grads(model, autocast=False)
    eager = grads(model)
    for (nm, p), a, r, e in zip(model.named_parameters(), got, ref, eager):
        assert a.dtype == torch.float32, nm
        assert _rel(a, r) <= 2 * _rel(e, r) + 1e-6, (nm, _rel(a, r), _rel(e, r))


def test_hf_gradient_checkpointing():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=352,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   hidden_act="relu", max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).cuda()
    ids = torch.randint(0, 128, (4, 256), device="cuda")

    def grads(fn, dtype):
        model.to(dtype)
        model.zero_grad()
        out = fn(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        return {nm: p.grad.float().clone() for nm, p in model.named_parameters()}

    with _no_tf32():
        ref = grads(model, torch.float32)
    eager = grads(model, torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    compiled = torch.compile(model, backend="twell", options={"twell.ell_width": 32, "twell.path": "twell"})
    grads(compiled, torch.bfloat16)
    torch.cuda.synchronize()
    calls, paths, got = _ours(lambda: grads(compiled, torch.bfloat16))
    assert calls.count("twell::ffn_train_bwd") >= 2 and paths == {"twell"}, (calls, paths)   # sparse backwards
    for nm in ref:
        if ".mlp." in nm:
            assert _rel(got[nm], ref[nm]) <= 2 * _rel(eager[nm], ref[nm]) + 1e-6, (nm, _rel(got[nm], ref[nm]), _rel(eager[nm], ref[nm]))


def test_checkpoint_recompute_takes_its_forwards_path():
    """Non-reentrant checkpointing checks that the recompute saves tensors of the same shapes.
    The dense and sparse paths save backups of different row counts, so the recompute (run
    inside the backward) must not poll the policy: here a measurement that would turn the
    layer dense lands between the checkpointed forward and its recompute."""
    from torch.utils.checkpoint import checkpoint

    low = _ffn(4096, 256, 1024, 256, 0.004, 0.0, seed=23)
    busy = list(low)
    busy[2] = low[2] + 3.0

    def call(args):
        return torch.ops.twell.ffn_train(*args, 64, 16, 0.0, "ck", False)[0]

    for _ in range(2):                     # dense, then sparse once the low density landed
        call(low)
        torch.cuda.synchronize()
    leaves = [a.detach().requires_grad_() for a in low]
    y = checkpoint(lambda *a: call(a), *leaves, use_reentrant=False)
    assert _path(low[0], low[1], low[5], "ck") == "twell"
    call(busy)                              # polls low's probe, submits busy's (dense-worthy)
    torch.cuda.synchronize()
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, dy)   # the recompute: sparse again, same shapes
    assert _path(low[0], low[1], low[5], "ck") == "twell"
    ref = torch.autograd.grad(call(leaves), leaves, dy)
    assert _path(low[0], low[1], low[5], "ck") == "dense"  # outside a backward the landed density counts
    for g, r in zip(grads, ref):
        assert _rel(g, r) < 1e-2, _rel(g, r)


@pytest.mark.parametrize("gated", [True, False])
def test_first_auto_call_compiles_every_paths_kernels(gated):
    """A layer's first call on the auto plan runs the other paths once (outputs discarded), so
    a later switch to any path compiles nothing mid-run; its own result is unchanged."""
    import triton

    args = _ffn(1536, 192, 700, 136, 0.01, 0.2, gated=gated, seed=3)
    dy = torch.randn(1536, 136, device="cuda", dtype=args[0].dtype)
    y_auto, g_auto = _twell_grads(args, dy, 0.5, 64, 16, "auto", calls=1)     # warms every path
    compiled = []
    old = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = (
        lambda *a, **kw: (kw.get("already_compiled") or compiled.append(kw.get("fn"))) and False)
    try:
        for path in ("twell", "compact", "dense"):
            _twell_grads(args, dy, 0.5, 64, 16, path, calls=1)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = old
    assert compiled == [], f"kernels compiled after the first call: {compiled}"
    y_dense, g_dense = _twell_grads(args, dy, 0.5, 64, 16, "dense", calls=1)
    assert torch.equal(y_auto, y_dense)        # the first auto call ran dense, as before the warm-up
    names = [nm for nm, a in zip(NAMES, args) if a is not None]
    for nm, a, b in zip(names, g_auto, g_dense):
        if nm in ("b_gate", "b_up"):   # fp32 atomics over row tiles (train_dense_bwd_kernel): order varies
            assert _rel(a, b) < 1e-2, (nm, _rel(a, b))
        else:
            assert torch.equal(a, b), nm


@pytest.mark.parametrize("path", ["twell", "compact", "dense"])
def test_a_coefficient_tensor_scales_the_penalty_on_the_device(path):
    """twell.target_density's coefficient reaches every CUDA backward as a [1] device tensor:
    l1_scale s with l1_coef [c] gives the gradients of l1_scale s * c (s = 0.25, c = 4: as close
    as two runs of the same call, bit for bit on the dense path, whose sums take no atomics), and a coefficient changed in place is read by the
    next call, whose Triton kernels are the ones already built (no host sync, no recompile)."""
    x, wg, bg, wu, bu, wd, bd = _ffn(4096, 256, 1024, 256, 0.01, 0.0, seed=31)
    dy = torch.randn(4096, 256, device="cuda", dtype=x.dtype)
    out = torch.ops.twell.ffn_train(x, wg, bg, wu, bu, wd, bd, 64, 16, 0.0, "coef", False, 0, path)
    state = list(out[1:8])
    assert out[8].shape == (0,)                          # not controlled: no coefficient tensor
    fixed = torch.ops.twell.ffn_train_bwd(dy, x, wg, bg, wu, bu, wd, *state, out[8], 1.0)
    again = torch.ops.twell.ffn_train_bwd(dy, x, wg, bg, wu, bu, wd, *state, out[8], 1.0)
    coef = torch.full((1,), 4.0, device="cuda")
    scaled = torch.ops.twell.ffn_train_bwd(dy, x, wg, bg, wu, bu, wd, *state, coef, 0.25)
    for a, r, b in zip(fixed, again, scaled):
        if a is None:
            assert b is None
            continue
        # the sparse paths' weight gradients sum with atomics: a repeat of the same call differs
        # by a few ulps (H100: up to 0.0625 of the twell path's gradients), each element by at
        # most a rounding at its own magnitude; no more than that
        spread = (a.float() - r.float()).abs().max().item()
        ulp = torch.finfo(a.dtype).eps * a.float().abs()
        err = (a.float() - b.float()).abs()
        assert (err <= 2 * spread + 2 * ulp).all(), (path, spread, err.max().item())
    coef.fill_(0.0)                                      # the controller moved it, in place
    none = torch.ops.twell.ffn_train_bwd(dy, x, wg, bg, wu, bu, wd, *state, coef, 0.25)
    plain = torch.ops.twell.ffn_train_bwd(dy, x, wg, bg, wu, bu, wd, *state, out[8], 0.0)
    for a, b in zip(none, plain):
        torch.testing.assert_close(a, b)
    assert not torch.equal(none[1], fixed[1])
