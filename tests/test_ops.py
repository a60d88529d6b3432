"""The twell ops: opcheck, numerics against dense autograd, argument errors, L1 gradient."""

import pytest
import torch
import torch.nn.functional as F

import twell_compile.ops  # noqa: F401
from twell_compile import layer_stats, reset_stats
from twell_compile.reference import ffn_dense

OPS = torch.ops.twell


def make(m, k, n, kout, dtype=torch.float32, gated=True, bias=True, density=0.3, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    wg = torch.randn(n, k, generator=g).to(dtype) / k ** 0.5
    # A bias that switches off about (1 - density) of the gate pre-activations.
    shift = torch.distributions.Normal(0, 1).icdf(torch.tensor(1 - density).clamp(1e-6, 1 - 1e-6))
    bg = (-shift * torch.ones(n)).to(dtype) if bias else None
    wu = torch.randn(n, k, generator=g).to(dtype) / k ** 0.5 if gated else None
    bu = torch.randn(n, generator=g).to(dtype) if (bias and gated) else None
    wd = torch.randn(kout, n, generator=g).to(dtype) / n ** 0.5
    bd = torch.randn(kout, generator=g).to(dtype) if bias else None
    ts = [x, wg, bg, wu, bu, wd, bd]
    if grad:
        ts = [t.requires_grad_() if t is not None else None for t in ts]
    return ts


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_opcheck_inference(gated, bias):
    args = make(5, 8, 12, 7, gated=gated, bias=bias)
    torch.library.opcheck(OPS.ffn.default, (*args, "t", True))


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_opcheck_training(gated, bias):
    args = make(6, 8, 12, 7, gated=gated, bias=bias, density=0.5, grad=True)
    # ell_width 3 and a one-row backup force busy rows into the backup and the recompute path.
    torch.library.opcheck(OPS.ffn_train.default, (*args, 3, 6, 0.0, "t", True))


@pytest.mark.parametrize("act", ["relu2", "drelu"])
def test_opcheck_activations(act):
    args = make(6, 8, 12, 7, density=0.5)
    torch.library.opcheck(OPS.ffn.default, (*args, "t", True, 0, "auto", act))
    leaves = [t.detach().clone().requires_grad_() for t in args]
    torch.library.opcheck(OPS.ffn_train.default, (*leaves, 3, 6, 0.1, "t", True, 0, "auto", None, act))
    _, *saved = OPS.ffn_train(*args, 3, 2, 0.0, "t", False, 0, "auto", None, act)
    torch.library.opcheck(OPS.ffn_train_bwd.default, (torch.randn(6, 7), *args[:6], *saved, 1e-3, act))


def test_opcheck_backward_op():
    x, wg, bg, wu, bu, wd, bd = make(6, 8, 12, 7)
    _, *saved = OPS.ffn_train(x, wg, bg, wu, bu, wd, bd, 3, 2, 0.0, "t", False)
    dy = torch.randn(6, 7)
    torch.library.opcheck(OPS.ffn_train_bwd.default, (dy, x, wg, bg, wu, bu, wd, *saved, 1e-3))


@pytest.mark.parametrize("shape", [(1, 3, 5, 2), (17, 9, 33, 9), (4, 1, 1, 1), (0, 8, 12, 8)])
@pytest.mark.parametrize("gated", [True, False])
def test_inference_matches_dense_exactly(shape, gated):
    m, k, n, kout = shape
    args = make(m, k, n, kout, gated=gated, seed=m * 31 + n)
    y = OPS.ffn(*args, "t", False)
    assert torch.equal(y, ffn_dense(*args))


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("ell_width, backup_rows", [(64, 16), (2, 1), (2, 1000)])
@pytest.mark.parametrize("density", [0.0, 0.05, 0.5, 1.0])
def test_training_gradients_match_autograd(dtype, tol, ell_width, backup_rows, density):
    """Busy rows in the ELL part, the dense backup, and beyond it (recomputed), any density."""
    ref = make(13, 10, 24, 6, dtype=dtype, density=density, seed=int(density * 100) + ell_width, grad=True)
    mine = [t.detach().clone().requires_grad_() if t is not None else None for t in ref]
    dy = torch.randn(13, 6, dtype=dtype)
    ffn_dense(*ref).backward(dy)
    y = OPS.ffn_train(*mine, ell_width, backup_rows, 0.0, "t", False)[0]
    assert torch.allclose(y, ffn_dense(*ref), atol=tol, rtol=0)
    y.backward(dy)
    for a, b in zip(ref, mine):
        if a is not None:
            torch.testing.assert_close(b.grad, a.grad, atol=tol, rtol=tol)


def test_l1_scale_matches_explicit_penalty():
    ref = make(9, 8, 20, 5, density=0.4, seed=3, grad=True)
    mine = [t.detach().clone().requires_grad_() if t is not None else None for t in ref]
    coef = 0.37
    x, wg, bg, wu, bu, wd, bd = ref
    h = F.relu(F.linear(x, wg, bg)) * F.linear(x, wu, bu)
    (F.linear(h, wd, bd).sum() + coef * h.abs().mean()).backward()
    OPS.ffn_train(*mine, 4, 4, coef, "t", False)[0].sum().backward()
    for a, b in zip(ref, mine):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-5)


def test_nan_in_x_propagates_like_dense():
    args = make(4, 8, 16, 5, density=0.1, grad=True)
    with torch.no_grad():
        args[0][1, 3] = float("nan")
    y = OPS.ffn_train(*args, 2, 2, 0.0, "t", False)[0]
    ref = ffn_dense(*args)
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    y.sum().backward()
    assert torch.isnan(args[0].grad[1]).all() and not torch.isnan(args[0].grad[0]).any()


def test_stats_recorded_without_reading():
    reset_stats()
    args = make(8, 8, 16, 5, density=0.25)
    OPS.ffn(*args, "layer.a", True)
    s = layer_stats()["layer.a"]
    hg = torch.relu(F.linear(args[0], args[1], args[2]))
    nnz = (hg != 0).sum(-1).float()
    assert s.tokens == 8 and s.hidden == 16
    assert s.mean_nnz == pytest.approx(nnz.mean().item()) and s.max_nnz == int(nnz.max())
    h = hg * F.linear(args[0], args[3], args[4])
    assert s.l1 == pytest.approx(h.abs().mean().item(), rel=1e-5)
    reset_stats()
    assert layer_stats() == {}


def test_training_stats_count_overflows():
    reset_stats()
    args = make(10, 8, 16, 5, density=0.9)
    OPS.ffn_train(*args, 2, 5, 0.0, "layer.b", True)  # backup holds 2 rows; ~all 10 are busy
    s = layer_stats()["layer.b"]
    busy = int(((torch.relu(F.linear(args[0], args[1], args[2])) != 0).sum(-1) > 2).sum())
    assert s.overflows == max(busy - 2, 0) and s.overflows > 0


@pytest.mark.parametrize("change, err, match", [
    (lambda a: a.__setitem__(1, torch.randn(12, 9)), ValueError, "w_gate"),
    (lambda a: a.__setitem__(3, torch.randn(11, 8)), ValueError, "w_up"),
    (lambda a: a.__setitem__(5, torch.randn(7, 13)), ValueError, "w_down"),
    (lambda a: a.__setitem__(2, torch.randn(3)), ValueError, "b_gate"),
    (lambda a: a.__setitem__(6, torch.randn(3)), ValueError, "b_down"),
    (lambda a: a.__setitem__(1, a[1].double()), TypeError, "w_gate has dtype"),
    (lambda a: a.__setitem__(0, torch.ones(5, 8, dtype=torch.int64)), TypeError, "x must be floating"),
    (lambda a: a.__setitem__(3, None), ValueError, "b_up given without w_up"),
    # near misses of the per-call fast test (ops._fits), each one check away from passing
    (lambda a: a.__setitem__(4, torch.randn(11)), ValueError, "b_up"),
    (lambda a: a.__setitem__(2, torch.randn(1, 12)), ValueError, "b_gate"),
    (lambda a: a.__setitem__(3, a[3].double()), TypeError, "w_up has dtype"),
    (lambda a: a.__setitem__(6, a[6].half()), TypeError, "b_down has dtype"),
    (lambda a: a.__setitem__(3, torch.randn(12, 9)), ValueError, "w_up"),
    (lambda a: a.__setitem__(0, torch.tensor(1.0)), ValueError, "x must have at least one dimension"),
])
def test_bad_arguments_name_the_argument(change, err, match):
    args = make(5, 8, 12, 7)
    change(args)
    with pytest.raises(err, match=match):
        OPS.ffn(*args, "t", False)


def test_bad_knobs():
    args = make(5, 8, 12, 7)
    with pytest.raises(ValueError, match="ell_width"):
        OPS.ffn_train(*args, 0, 2, 0.0, "t", False)
    with pytest.raises(ValueError, match="path must be one of"):
        OPS.ffn(*args, "t", False, 0, "fast")
    with pytest.raises(ValueError, match="path must be one of"):
        OPS.ffn_train(*args, 4, 2, 0.0, "t", False, 0, "decode")      # an inference-only path
    with pytest.raises(ValueError, match="CUDA path"):
        OPS.ffn(*args, "t", False, 0, "twell")                          # CPU tensors


@pytest.mark.parametrize("which, name", [(0, "x"), (1, "w_gate"), (4, "b_up"), (6, "b_down")])
def test_inference_op_refuses_inputs_that_need_grad(which, name):
    """twell::ffn has no backward: a call that would need one is refused up front, naming the
    argument, not run with its gradient silently missing; under no_grad it runs."""
    args = make(5, 8, 12, 7)
    args[which].requires_grad_()
    with pytest.raises(ValueError, match=f"{name} requires grad"):
        OPS.ffn(*args, "t", False)
    with torch.no_grad():
        y = OPS.ffn(*args, "t", False)
    assert not y.requires_grad
    torch.testing.assert_close(y, ffn_dense(*[a.detach() if a is not None else None for a in args]))


@pytest.mark.parametrize("lead", [(0,), (3, 0)])
@pytest.mark.parametrize("gated", [True, False])
def test_training_with_no_rows_matches_eager(lead, gated):
    """x [0, K] or [B, 0, K]: an empty y, and as eager's autograd an empty dx and zero weight
    and bias gradients (the backup of 2 rows is all padding: nothing to index)."""
    ref = make(1, 8, 12, 7, gated=gated, grad=True)
    ref[0] = torch.randn(*lead, 8, requires_grad=True)
    mine = [t.detach().clone().requires_grad_() if t is not None else None for t in ref]
    want = ffn_dense(*ref)
    y = OPS.ffn_train(*mine, 4, 2, 0.5, "t", True)[0]
    assert y.shape == want.shape == (*lead, 7)
    dy = torch.randn(*lead, 7)
    want.backward(dy)
    y.backward(dy)
    for a, b in zip(ref, mine):
        if a is not None:
            assert b.grad.shape == a.grad.shape and torch.equal(b.grad, a.grad)
    with torch.no_grad():
        assert OPS.ffn(*mine, "t", True).shape == (*lead, 7)


@pytest.mark.parametrize("widths", [(8, 0, 7), (0, 12, 7), (8, 12, 0), (0, 0, 0)], ids=lambda w: "K%d-N%d-Kout%d" % w)
@pytest.mark.parametrize("gated", [True, False])
def test_a_width_of_zero_matches_eager(widths, gated):
    """An FFN pruned to N=0 (or K, K_out of 0) raised "cannot reshape tensor of 0 elements into
    shape [-1, 0]" (inference) and "width must be a positive int, got 0" (training): eager
    gives b_down (N=0), and its autograd zero or empty gradients."""
    k, n, k_out = widths
    ref = make(5, k, n, k_out, gated=gated, grad=True)
    mine = [t.detach().clone().requires_grad_() if t is not None else None for t in ref]
    want = ffn_dense(*ref)
    reset_stats()
    y = OPS.ffn_train(*mine, 4, 2, 0.0, "t", True)[0]
    torch.testing.assert_close(y, want)
    dy = torch.randn(5, k_out)
    want.backward(dy)
    y.backward(dy)
    for a, b in zip(ref, mine):
        if a is not None:
            torch.testing.assert_close(b.grad, a.grad)
    with torch.no_grad():
        torch.testing.assert_close(OPS.ffn(*mine, "t", True), want)
    assert layer_stats()["t"].hidden == n


@pytest.mark.parametrize("l1", [float("nan"), float("inf"), -1.0])
def test_training_op_refuses_a_non_finite_or_negative_l1_scale(l1):
    args = make(5, 8, 12, 7, grad=True)
    with pytest.raises(ValueError, match="l1_scale"):
        OPS.ffn_train(*args, 4, 2, l1, "t", False)


def test_instance_and_path_arguments_default_and_reach_the_runtime(monkeypatch):
    """The op's arguments after ``stats`` name its instance (per-op runtime state; direct calls:
    0), the path it must take ("auto": the plan's choice), the activation ("relu") and the owner
    weight that names the calling module (None: the op's own layer and instance)."""
    from twell_compile.runtime import execute

    seen = []
    real = execute.ffn_infer
    monkeypatch.setattr(execute, "ffn_infer", lambda *a: seen.append(a[-3:]) or real(*a))
    args = make(5, 8, 12, 7)
    OPS.ffn(*args, "t", False)
    OPS.ffn(*args, "t", False, 9, "torch")
    OPS.ffn(*args, "t", False, 9, "torch", act="relu2")
    assert seen == [(0, "auto", "relu"), (9, "torch", "relu"), (9, "torch", "relu2")]
    assert [a.name for a in OPS.ffn.default._schema.arguments[-4:]] == ["instance", "path", "act", "owner"]
    assert [a.name for a in OPS.ffn_train.default._schema.arguments[-6:]] == ["instance", "path", "tag", "act",
                                                                               "l1_control", "owner"]
    assert [a.name for a in OPS.ffn_train_bwd.default._schema.arguments[-4:]] == ["l1_coef", "l1_scale", "act", "db_down"]


@pytest.mark.parametrize("act", ["relu2", "drelu"])
@pytest.mark.parametrize("gated", [True, False])
def test_activations_match_the_oracle_with_gradients(act, gated):
    """act="relu2" (squared ReLU) and "drelu" (relu(gate) * relu(up)): the inference op and the
    training op's forward and backward (the L1 term on the h fed to down included) as autograd
    of reference.ffn_dense computes them."""
    from twell_compile.reference import ffn_dense, ffn_hidden, activate

    if act == "drelu" and not gated:
        with pytest.raises(ValueError, match="act='drelu'.*needs w_up"):
            OPS.ffn(*make(5, 8, 12, 7, gated=False), "t", False, 0, "auto", act)
        return
    args = make(9, 8, 12, 7, gated=gated)
    with torch.no_grad():
        torch.testing.assert_close(OPS.ffn(*args, "t", False, 0, "auto", act), ffn_dense(*args, act))
    leaves = [None if a is None else a.detach().clone().requires_grad_() for a in args]
    y = OPS.ffn_train(*leaves, 4, 2, 0.3, "t", False, 0, "auto", None, act)[0]
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [a for a in leaves if a is not None], dy)
    ref = [None if a is None else a.detach().double().requires_grad_() for a in args]
    h = activate(*ffn_hidden(*ref[:5]), act)
    loss = (F.linear(h, ref[5], ref[6]) * dy.double()).sum() + 0.3 * h.abs().mean()
    want = torch.autograd.grad(loss, [a for a in ref if a is not None])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)


def test_bad_activation_is_refused_with_its_name():
    args = make(5, 8, 12, 7)
    for op_call in (lambda: OPS.ffn(*args, "t", False, 0, "auto", "gelu"),
                    lambda: OPS.ffn_train(*args, 4, 2, 0.0, "t", False, 0, "auto", None, "silu")):
        with pytest.raises(ValueError, match="act must be one of 'relu', 'relu2', 'drelu'"):
            op_call()


def test_tag_names_the_instance_and_layer_of_a_training_call(monkeypatch):
    """ffn_train's tag (ops.tag: a 0-d int64 CPU tensor) replaces its instance and layer
    arguments at run time; anything else is refused, by the op and by its fake."""
    from twell_compile import ops
    from twell_compile.runtime import execute

    seen = []
    real = execute.ffn_train_forward
    monkeypatch.setattr(execute, "ffn_train_forward", lambda *a: seen.append((a[9], a[11])) or real(*a))
    t = ops.tag("blocks.3.mlp")
    assert t.dtype == torch.int64 and t.dim() == 0 and ops.tagged(t) == (int(t), "blocks.3.mlp")
    assert int(ops.tag("other")) != int(t)
    args = make(5, 8, 12, 7, grad=True)
    OPS.ffn_train(*args, 4, 8, 0.0, "", True, 0, "auto", t)[0].sum().backward()
    OPS.ffn_train(*args, 4, 8, 0.0, "named", True, 3)
    assert seen == [("blocks.3.mlp", int(t)), ("named", 3)]
    for bad, err in ((torch.tensor(1.0), TypeError), (torch.tensor([int(t)]), TypeError),
                     (torch.tensor(10 ** 9), ValueError)):
        with pytest.raises(err, match="tag"):
            OPS.ffn_train(*args, 4, 8, 0.0, "", True, 0, "auto", bad)
    with torch._subclasses.FakeTensorMode() as mode, pytest.raises(TypeError, match="tag"):
        fake = [mode.from_tensor(a) if a is not None else None for a in args]
        OPS.ffn_train(*fake, 4, 8, 0.0, "", True, 0, "auto", mode.from_tensor(torch.tensor(1.0)))


# ---------------------------------------------------------------------------- MoE experts
def _experts_ref(x, wg, wu, wd, offs, act="relu"):
    from twell_compile.reference import activate

    y, start = [], 0
    for e, end in enumerate(offs.tolist()):
        xe = x[start:end]
        y.append(F.linear(activate(F.relu(F.linear(xe, wg[e])), None if wu is None else F.linear(xe, wu[e]), act),
                          wd[e]))
        start = end
    y.append(x.new_zeros((x.shape[0] - start, wd.shape[1])))
    return torch.cat(y)


def _experts_args(gated=True, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    e, n, k, kout = 3, 12, 8, 6
    ts = [torch.randn(10, k, generator=g), torch.randn(e, n, k, generator=g) / k ** 0.5,
          torch.randn(e, n, k, generator=g) / k ** 0.5 if gated else None, torch.randn(e, kout, n, generator=g) / n ** 0.5]
    if grad:
        ts = [t.requires_grad_() if t is not None else None for t in ts]
    return ts, torch.tensor([4, 4, 8])          # expert 1 empty, rows 8-9 past the end


@pytest.mark.parametrize("gated,act", [(True, "relu"), (False, "relu"), (True, "relu2"), (True, "drelu")])
def test_experts_inference_and_training_match_each_expert(gated, act):
    (x, wg, wu, wd), offs = _experts_args(gated)
    reset_stats()
    with torch.no_grad():
        y = OPS.experts(x, wg, wu, wd, offs, "moe", True, act=act)
    torch.testing.assert_close(y, _experts_ref(x, wg, wu, wd, offs, act), rtol=1e-5, atol=1e-5)
    assert sorted(layer_stats()) == ["moe.0", "moe.2"]       # the empty expert runs nothing
    ts, offs = _experts_args(gated, grad=True)
    ys = OPS.experts_train(*ts, offs, 4, 2, 0.0, "moe", False, act=act)
    ref = _experts_ref(*ts, offs, act)
    torch.testing.assert_close(ys[0], ref, rtol=1e-5, atol=1e-5)
    assert ys[-1].tolist() == [int(ys[5][:int(ys[-1][0])].shape[0]), int(ys[-1][0]), int(ys[5].shape[0])]
    dy = torch.randn_like(ref)
    params = [t for t in ts if t is not None]
    for a, b in zip(torch.autograd.grad(ys[0], params, dy), torch.autograd.grad(ref, params, dy)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_experts_l1_is_a_mean_over_every_routed_row():
    ts, offs = _experts_args(grad=True)
    l1 = 0.7
    y = OPS.experts_train(*ts, offs, 4, 2, l1, "moe", False)[0]
    x, wg, wu, wd = ts
    hs = []
    start = 0
    for e, end in enumerate(offs.tolist()):
        hs.append(F.relu(F.linear(x[start:end], wg[e])) * F.linear(x[start:end], wu[e]))
        start = end
    h = torch.cat(hs)
    dy = torch.randn_like(y)
    want = torch.autograd.grad((_experts_ref(*ts, offs) * dy).sum() + l1 * h.abs().mean(), ts)
    for a, b in zip(torch.autograd.grad((y * dy).sum(), ts), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_experts_opcheck():
    ts, offs = _experts_args(grad=True)
    torch.library.opcheck(OPS.experts_train.default, (*ts, offs, 4, 2, 0.1, "moe", False))
    (x, wg, wu, wd), offs = _experts_args()
    torch.library.opcheck(OPS.experts.default, (x, wg, wu, wd, offs, "moe", False))


@pytest.mark.parametrize("change,match", [
    (lambda a: {**a, "offs": torch.tensor([4, 2, 8])}, "non-decreasing"),
    (lambda a: {**a, "offs": torch.tensor([4, 4, 11])}, "non-decreasing"),
    (lambda a: {**a, "offs": torch.tensor([4.0, 4.0, 8.0])}, "int32/int64"),
    (lambda a: {**a, "offs": torch.tensor([4, 8])}, r"offs must be .*\[E=3\]"),
    (lambda a: {**a, "wd": a["wd"][:, :, :5]}, r"w_down must be \[E=3, K_out, N=12\]"),
    (lambda a: {**a, "x": a["x"][None]}, "2-D"),
])
def test_experts_argument_errors(change, match):
    (x, wg, wu, wd), offs = _experts_args()
    a = change({"x": x, "wg": wg, "wu": wu, "wd": wd, "offs": offs})
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        OPS.experts(a["x"], a["wg"], a["wu"], a["wd"], a["offs"], "moe", False)
