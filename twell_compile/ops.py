"""The ``twell`` operator library: schemas, argument checks, fakes and autograd.

    twell::ffn            inference FFN, y = down(relu(gate(x)) [* up(x)])
    twell::ffn_train      the same forward for training; also returns the hidden activations in
                          the hybrid format (the only activations saved for backward)
    twell::ffn_train_bwd  its backward: gradients of x, weights and biases, L1 term folded in
    twell::experts        a mixture-of-experts block's expert FFNs: x [S, K] grouped by expert,
                          weights [E, N, K] / [E, K_out, N], ``offs`` [E] each expert's
                          cumulative end row (``torch._grouped_mm``'s offsets); expert e runs
                          the FFN above on its rows (layer ``{layer}.{e}``), rows past offs[-1]
                          give zeros. No biases (HF's batched experts have none).
    twell::experts_train, twell::experts_train_bwd
                          the same for training: each expert's hybrid state concatenated by
                          rows (runtime/execute.py), the L1 term a mean over every routed row

``instance`` (default 0) names the op instance whose runtime state (the CUDA path's density
measurements) a call reads and writes: the passes and ``prepare`` give each op they insert a
number unique in the process (``next_instance``); 0, for direct calls, shares the state by
layer name. ``path`` (after ``instance``, default "auto") forces a path (runtime/select.py: "dense",
"twell", "decode", "decode-<form>", "cpu", "torch" for inference; "dense", "compact", "twell"
for training); a forced path that cannot run the call raises ``ValueError``. (Not named
``kernel``: Inductor's fallback lowering takes that keyword itself.)

``owner`` (last, default None; twell::ffn, ffn_train, experts, experts_train): the down
projection's weight as the compiled graph received it, a parameter of the module that runs the
call. The backend passes it where Dynamo lifts parameters as graph inputs: one graph then serves
every module of the same code (``module.compile()`` on each block, a second model of the class),
and the call's ``layer`` and ``instance`` are those of the module holding ``owner``
(``runtime/names.py``: a cached lookup keyed on the weight object), not the first module's.

``tag`` (twell::ffn_train only, after ``path``, default None): a 0-d int64 CPU tensor made by ``tag``,
holding an instance number; when given it replaces ``instance`` and ``layer`` (the name ``tag``
recorded) at run time. ``prepare`` gives each prepared module one, so the op's per-layer
arguments are tensor inputs, not constants: Dynamo compiles one graph for every block that
shares its code (FSDP2's per-block frames, regional compilation), where constants would
recompile each block, past Dynamo's limit of 8 (the rest then ran eager).

``act`` (after ``path`` and ``tag``; ffn_train_bwd's last; default "relu"; reference.ACTS): the activation. "relu2" is squared ReLU,
h = relu(g)^2 [* u]; "drelu" (gated only) h = relu(g) * relu(u). All share relu(g)'s zero
pattern, which every path skips; the training state saves relu(g) and u at its non-zeros (for
dReLU the plain-PyTorch path only where relu(u) is non-zero too: runtime/torch_impl.py) and the
backward forms the activation's derivative from them. Anything else raises ``ValueError``.

``l1_control`` (twell::ffn_train only, last, default False): the layer's L1 coefficient is
adapted by the controller of ``twell.target_density`` (``twell_compile/control.py``): each call
counts its non-zeros there and returns the coefficient its backward applies as a ninth output
``l1_coef`` ([1] fp32 on x's device; [0] without ``l1_control``), a device tensor, so a changed
coefficient recompiles nothing and syncs nothing. twell::ffn_train_bwd takes it back (after
the saved state): with one element, its penalty is ``l1_scale * l1_coef[0] * mean(|h|)``; empty,
``l1_scale * mean(|h|)`` as with a fixed ``twell.l1``.

``w_up=None`` selects the non-gated FFN down(relu(gate(x))). Weights use nn.Linear's layout:
w_gate, w_up [N, K]; w_down [K_out, N]. Biases are optional. Every tensor must share x's dtype
and device. ``runtime/select.py`` chooses the kernel, ``runtime/execute.py`` runs it; this
module only registers. Importing it initialises no device and builds nothing.

``static_reason`` and ``static_path`` are the plan's compile-time twins (runtime/select.py),
re-exported here for the graph passes: why a rewritten FFN would surely run slower than
Inductor's code (or None), and what it will run, in words.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from twell_compile.config import PATHS
from twell_compile.formats import backup_capacity, ell_width_for
from twell_compile.reference import check_act
from twell_compile.runtime import execute, names, select
from twell_compile.runtime.density import mark_graphs
from twell_compile.runtime.names import caller_modules, declare, next_instance
from twell_compile.runtime.select import experts_reason, static_path, static_reason

# The CUDA bf16/fp16 training path (kernels/cuda_train.py) is sync-free and captures in a CUDA
# graph (tests/kernels/test_cuda_train.py), but tags are per op, not per device or dtype: CUDA
# fp32 (and widths the kernels do not take) run the plain-PyTorch path, whose hybrid packing
# and exact recompute use data-dependent indexing (host syncs). So capture must leave these
# ops out: Inductor splits CUDA graphs around them instead of skipping CUDA graphs.
_TRAIN_TAGS = (torch.Tag.cudagraph_unsafe,)


def _same_dtype_and_device(x: Tensor, named: dict) -> None:
    """Raise unless every tensor of ``named`` (None skipped) has x's dtype and device."""
    for name, t in named.items():
        if t is None or t is x:
            continue
        if t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but x has {x.dtype}; cast them to one dtype")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def _check(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
           b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor]) -> None:
    if _fits(x, w_gate, b_gate, w_up, b_up, w_down, b_down):
        return
    _explain(x, w_gate, b_gate, w_up, b_up, w_down, b_down)


def _fits(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
          b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor]) -> bool:
    """Whether the arguments pass every check of ``_explain``: the per-call test, plain
    comparisons in one pass (no dict, no message built); _explain names what fails."""
    try:
        dt, dev = x.dtype, x.device
        if not (x.is_floating_point() and x.dim() >= 1 and w_gate.dim() == 2 and w_down.dim() == 2):
            return False
        n, k = w_gate.shape
        if (x.shape[-1] != k or w_down.shape[1] != n or w_gate.dtype != dt or w_down.dtype != dt
                or w_gate.device != dev or w_down.device != dev):
            return False
        if w_up is None:
            if b_up is not None:
                return False
        elif w_up.shape != w_gate.shape or w_up.dtype != dt or w_up.device != dev:
            return False
        for b, size in ((b_gate, n), (b_up, n), (b_down, w_down.shape[0])):
            if b is not None and (b.dim() != 1 or b.shape[0] != size or b.dtype != dt or b.device != dev):
                return False
        return True
    except (AttributeError, TypeError, ValueError):     # not tensors: _explain says which
        return False


def _explain(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
             b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor]) -> None:
    """Raise naming the first argument that fails (a TypeError or ValueError)."""
    named = {"x": x, "w_gate": w_gate, "b_gate": b_gate, "w_up": w_up, "b_up": b_up,
             "w_down": w_down, "b_down": b_down}
    for name, t in named.items():
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be floating point, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the feature dimension)")
    _same_dtype_and_device(x, named)
    k = x.shape[-1]
    if w_gate.dim() != 2 or w_gate.shape[1] != k:
        raise ValueError(f"w_gate must be [N, K={k}], got {tuple(w_gate.shape)}")
    n = w_gate.shape[0]
    if w_up is not None and tuple(w_up.shape) != (n, k):
        raise ValueError(f"w_up must be [N={n}, K={k}] like w_gate, got {tuple(w_up.shape)}")
    if w_up is None and b_up is not None:
        raise ValueError("b_up given without w_up")
    if w_down.dim() != 2 or w_down.shape[1] != n:
        raise ValueError(f"w_down must be [K_out, N={n}], got {tuple(w_down.shape)}")
    for name, b, size in (("b_gate", b_gate, n), ("b_up", b_up, n), ("b_down", b_down, w_down.shape[0])):
        if b is not None and tuple(b.shape) != (size,):
            raise ValueError(f"{name} must be [{size}], got {tuple(b.shape)}")


_tag_layers: dict[int, str] = {}       # tag's instance number -> its layer name


def tag(layer: str) -> Tensor:
    """A fresh instance number for ``layer`` as a 0-d int64 CPU tensor (``ffn_train``'s ``tag``)."""
    number = next_instance()
    _tag_layers[number] = layer
    return torch.tensor(number, dtype=torch.int64, device="cpu")    # (whatever the default device)


def _check_tag(t: object) -> None:
    if not isinstance(t, Tensor) or t.dim() != 0 or t.dtype != torch.int64 or t.device.type != "cpu":
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"tag must be a 0-d int64 CPU tensor made by twell_compile.ops.tag, got {got}")


def tagged(t: Tensor) -> tuple[int, str]:
    """(instance, layer) of a tag made by ``tag``; reading a CPU tensor syncs nothing."""
    _check_tag(t)
    number = int(t)
    if number not in _tag_layers:
        raise ValueError(f"tag {number} was not made by twell_compile.ops.tag in this process")
    return number, _tag_layers[number]


def _check_coef(t: Tensor, x: Tensor) -> None:
    if t.dtype != torch.float32 or t.dim() != 1 or t.shape[0] > 1 or t.device != x.device:
        raise ValueError(f"l1_coef must be a float32 tensor of 0 or 1 elements on x's device ({x.device}), got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")


def _check_positive(**knobs: int) -> None:
    for name, value in knobs.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


# ---------------------------------------------------------------------------- inference
# Defined through torch.library.Library, not custom_op: custom_op's Python autograd and
# aliasing layers cost 43 us of host time per eager call (bench_host.py,
# docs/design-notes/host.md), more than the decode kernels' GPU time. The op is inference only: its Autograd key falls through, and a call that would
# need a gradient is refused up front (the backend rewrites to ffn_train when one is needed).
_lib = torch.library.Library("twell", "FRAGMENT")
_lib.define("ffn(Tensor x, Tensor w_gate, Tensor? b_gate, Tensor? w_up, Tensor? b_up, Tensor w_down, "
            "Tensor? b_down, str layer, bool stats, int instance=0, str path='auto', str act='relu', Tensor? owner=None) "
            "-> Tensor",
            tags=(torch.Tag.pt2_compliant_tag,))


def _ffn(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
         b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
         layer: str, stats: bool, instance: int = 0, path: str = "auto", act: str = "relu",
         owner: Optional[Tensor] = None) -> Tensor:
    _check(x, w_gate, b_gate, w_up, b_up, w_down, b_down)
    check_act(act, w_up is not None)
    select.check_path(path, select.INFER_PATHS, "inference")
    if torch.is_grad_enabled():
        for name, t in (("x", x), ("w_gate", w_gate), ("b_gate", b_gate), ("w_up", w_up),
                        ("b_up", b_up), ("w_down", w_down), ("b_down", b_down)):
            if t is not None and t.requires_grad:
                raise ValueError(f"{name} requires grad, and twell::ffn is inference only: call it "
                                 f"under torch.no_grad() / torch.inference_mode(), or use "
                                 f"twell::ffn_train, whose backward is ours")
    instance, layer = names.resolve(owner, instance, layer)
    return execute.ffn_infer(x, w_gate, b_gate, w_up, b_up, w_down, b_down, layer, stats, instance, path, act)


_lib.impl("ffn", _ffn, "CompositeExplicitAutograd")
_lib.impl("ffn", torch.library.fallthrough_kernel, "Autograd")


@torch.library.register_fake("twell::ffn", lib=_lib)
def _(x, w_gate, b_gate, w_up, b_up, w_down, b_down, layer, stats, instance=0, path="auto", act="relu", owner=None):
    _check(x, w_gate, b_gate, w_up, b_up, w_down, b_down)
    check_act(act, w_up is not None)
    select.check_path(path, select.INFER_PATHS, "inference")
    return x.new_empty((*x.shape[:-1], w_down.shape[0]))


# The gate GEMM with the TwELL packing in its epilogue (CUDA, sm90; csrc/gate_pack*.cu, built by
# runtime/cuda_gate.py on first use): g = x w^T + bias into ``g`` (when it has elements), and per
# row and tile of ``tile_n`` columns the non-zero count of relu(g) into ``tcnt`` [M, T] and its
# first S non-zeros in column order into ``packed`` [M, T, S], (column << 16) | bits(value).
# ``g_spills``: g only for the row tiles over their S slots or holding a non-finite value.
_lib.define("gate_pack(Tensor x, Tensor w, Tensor? bias, Tensor(a!) g, Tensor(b!) packed, Tensor(c!) tcnt, "
            "int cfg, int raster=0, int swizzle=1, bool g_spills=False) -> ()")


@torch.library.register_fake("twell::gate_pack", lib=_lib)
def _(x, w, bias, g, packed, tcnt, cfg, raster=0, swizzle=1, g_spills=False):
    return None


# ---------------------------------------------------------------------------- training
@torch.library.custom_op("twell::ffn_train", mutates_args=(), tags=_TRAIN_TAGS)
def ffn_train(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
              b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
              ell_width: int, backup_rows: int, l1_scale: float, layer: str, stats: bool,
              instance: int = 0, path: str = "auto", tag: Optional[Tensor] = None, act: str = "relu",
              l1_control: bool = False, owner: Optional[Tensor] = None
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (y, counts, cols, ell_g, ell_u, backup_idx, backup_g, backup_u, l1_coef); see
    formats.Hybrid and, for l1_coef, the module docstring."""
    _check(x, w_gate, b_gate, w_up, b_up, w_down, b_down)
    check_act(act, w_up is not None)
    if tag is not None:
        instance, layer = tagged(tag)
    else:
        instance, layer = names.resolve(owner, instance, layer)
    _check_positive(ell_width=ell_width, backup_rows=backup_rows)
    select.check_path(path, select.TRAIN_PATHS, "training")
    if not math.isfinite(l1_scale) or l1_scale < 0:
        raise ValueError(f"l1_scale must be a finite number >= 0, got {l1_scale}")
    return execute.ffn_train_forward(x, w_gate, b_gate, w_up, b_up, w_down, b_down,
                                     ell_width, backup_rows, layer, stats, instance, path, l1_scale, act,
                                     l1_control)


def _backup_rows(capacity):
    """Rows of the saved backup: the capacity when the forward ran sparse (and on the CPU), M
    when the CUDA dense path ran (it saves g and u whole, so its backward is eager's six GEMMs,
    not eight). The policy picks per call on the host, from lagged measurements: a fake tensor
    cannot know which, so under a ShapeEnv (torch.compile, export) this is one unbacked size for
    all three tensors. ``ctx.new_dynamic_size()`` is not used: it refuses whenever Dynamo's
    ShapeEnv was made without capture_dynamic_output_shape_ops, and the op only appears after
    Dynamo, inside our backend. Meta tensors (no ShapeEnv) get the capacity."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size

    env = getattr(detect_fake_mode(), "shape_env", None)
    if env is None:
        return capacity
    rows = env.create_unbacked_symint()
    _constrain_range_for_size(rows, min=0)
    return rows


@ffn_train.register_fake
def _(x, w_gate, b_gate, w_up, b_up, w_down, b_down, ell_width, backup_rows, l1_scale, layer, stats, instance=0,
      path="auto", tag=None, act="relu", l1_control=False, owner=None):
    _check(x, w_gate, b_gate, w_up, b_up, w_down, b_down)
    check_act(act, w_up is not None)
    if tag is not None:
        _check_tag(tag)
    select.check_path(path, select.TRAIN_PATHS, "training")
    m = math.prod(x.shape[:-1])
    n = w_gate.shape[0]
    width = ell_width_for(ell_width, n)
    rows = _backup_rows(backup_capacity(m, backup_rows))
    nu = 0 if w_up is None else None
    return (
        x.new_empty((*x.shape[:-1], w_down.shape[0])),
        x.new_empty((m,), dtype=torch.int32),
        x.new_empty((m, width), dtype=torch.int32),
        x.new_empty((m, width)),
        x.new_empty((m, width if nu is None else 0)),
        x.new_empty((rows,), dtype=torch.int64),
        x.new_empty((rows, n)),
        x.new_empty((rows, n if nu is None else 0)),
        x.new_empty((1 if l1_control else 0,), dtype=torch.float32),
    )


@torch.library.custom_op("twell::ffn_train_bwd", mutates_args=(), tags=_TRAIN_TAGS)
def ffn_train_bwd(dy: Tensor, x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor],
                  w_up: Optional[Tensor], b_up: Optional[Tensor], w_down: Tensor,
                  counts: Tensor, cols: Tensor, ell_g: Tensor, ell_u: Tensor,
                  backup_idx: Tensor, backup_g: Tensor, backup_u: Tensor, l1_coef: Tensor, l1_scale: float,
                  act: str = "relu", db_down: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw_gate, db_gate, dw_up, db_up, dw_down, db_down); absent ones are empty tensors.
    ``l1_coef``: the forward's ninth output ([1]: multiplies ``l1_scale``; [0]: none).
    ``db_down``: whether to sum dy for the down projection's bias (False: no bias, no pass over dy)."""
    check_act(act, w_up is not None)
    _check_coef(l1_coef, x)
    grads = execute.ffn_train_backward(dy, x, w_gate, b_gate, w_up, b_up, w_down, counts, cols,
                                       ell_g, ell_u, backup_idx, backup_g, backup_u, l1_scale=l1_scale,
                                       l1_coef=l1_coef if l1_coef.numel() else None, act=act, db_down=db_down)
    return tuple(g if g is not None else x.new_empty(0) for g in grads)


@ffn_train_bwd.register_fake
def _(dy, x, w_gate, b_gate, w_up, b_up, w_down, counts, cols, ell_g, ell_u, backup_idx,
      backup_g, backup_u, l1_coef, l1_scale, act="relu", db_down=True):
    check_act(act, w_up is not None)
    _check_coef(l1_coef, x)
    def like(t: Optional[Tensor]) -> Tensor:
        return x.new_empty(0) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)

    return (like(x), like(w_gate), like(b_gate), like(w_up), like(b_up), like(w_down),
            x.new_empty((w_down.shape[0],) if db_down else (0,)))


# ---------------------------------------------------------------------------- MoE experts
def _check_experts(x: Tensor, w_gate: Tensor, w_up: Optional[Tensor], w_down: Tensor, offs: Tensor) -> None:
    for name, t in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down), ("offs", offs)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if not x.is_floating_point() or x.dim() != 2:
        raise ValueError(f"x must be a 2-D floating-point tensor [S, K], got {x.dtype} {tuple(x.shape)}")
    _same_dtype_and_device(x, {"w_gate": w_gate, "w_up": w_up, "w_down": w_down})
    if w_gate.dim() != 3 or w_gate.shape[2] != x.shape[1]:
        raise ValueError(f"w_gate must be [E, N, K={x.shape[1]}], got {tuple(w_gate.shape)}")
    e, n = w_gate.shape[0], w_gate.shape[1]
    if w_up is not None and tuple(w_up.shape) != tuple(w_gate.shape):
        raise ValueError(f"w_up must be [E={e}, N={n}, K] like w_gate, got {tuple(w_up.shape)}")
    if w_down.dim() != 3 or w_down.shape[0] != e or w_down.shape[2] != n:
        raise ValueError(f"w_down must be [E={e}, K_out, N={n}], got {tuple(w_down.shape)}")
    if offs.dim() != 1 or offs.shape[0] != e or offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offs must be an int32/int64 tensor [E={e}], got {offs.dtype} {tuple(offs.shape)}")
    if offs.device != x.device:
        raise ValueError(f"offs is on {offs.device} but x is on {x.device}")


_lib.define("experts(Tensor x, Tensor w_gate, Tensor? w_up, Tensor w_down, Tensor offs, str layer, bool stats, "
            "int instance=0, str path='auto', str act='relu', Tensor? owner=None) -> Tensor",
            tags=(torch.Tag.pt2_compliant_tag,))


def _experts(x: Tensor, w_gate: Tensor, w_up: Optional[Tensor], w_down: Tensor, offs: Tensor, layer: str,
             stats: bool, instance: int = 0, path: str = "auto", act: str = "relu",
             owner: Optional[Tensor] = None) -> Tensor:
    _check_experts(x, w_gate, w_up, w_down, offs)
    check_act(act, w_up is not None)
    select.check_path(path, select.INFER_PATHS, "inference")
    if torch.is_grad_enabled():
        for name, t in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
            if t is not None and t.requires_grad:
                raise ValueError(f"{name} requires grad, and twell::experts is inference only: call it under "
                                 f"torch.no_grad() / torch.inference_mode(), or use twell::experts_train")
    instance, layer = names.resolve(owner, instance, layer)
    return execute.experts_infer(x, w_gate, w_up, w_down, offs, layer, stats, instance, path, act)


_lib.impl("experts", _experts, "CompositeExplicitAutograd")
_lib.impl("experts", torch.library.fallthrough_kernel, "Autograd")


@torch.library.register_fake("twell::experts", lib=_lib)
def _(x, w_gate, w_up, w_down, offs, layer, stats, instance=0, path="auto", act="relu", owner=None):
    _check_experts(x, w_gate, w_up, w_down, offs)
    check_act(act, w_up is not None)
    select.check_path(path, select.INFER_PATHS, "inference")
    return x.new_empty((x.shape[0], w_down.shape[1]))


@torch.library.custom_op("twell::experts_train", mutates_args=(), tags=_TRAIN_TAGS)
def experts_train(x: Tensor, w_gate: Tensor, w_up: Optional[Tensor], w_down: Tensor, offs: Tensor,
                  ell_width: int, backup_rows: int, l1_scale: float, layer: str, stats: bool,
                  instance: int = 0, path: str = "auto", act: str = "relu", owner: Optional[Tensor] = None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (y, counts, cols, ell_g, ell_u, backup_idx, backup_g, backup_u, backup_offs):
    every expert's hybrid state, concatenated by rows (execute.experts_train_forward)."""
    _check_experts(x, w_gate, w_up, w_down, offs)
    check_act(act, w_up is not None)
    _check_positive(ell_width=ell_width, backup_rows=backup_rows)
    select.check_path(path, select.TRAIN_PATHS, "training")
    if not math.isfinite(l1_scale) or l1_scale < 0:
        raise ValueError(f"l1_scale must be a finite number >= 0, got {l1_scale}")
    instance, layer = names.resolve(owner, instance, layer)
    return execute.experts_train_forward(x, w_gate, w_up, w_down, offs, ell_width, backup_rows, layer, stats,
                                         instance, path, l1_scale, act)


@experts_train.register_fake
def _(x, w_gate, w_up, w_down, offs, ell_width, backup_rows, l1_scale, layer, stats, instance=0, path="auto",
      act="relu", owner=None):
    _check_experts(x, w_gate, w_up, w_down, offs)
    check_act(act, w_up is not None)
    select.check_path(path, select.TRAIN_PATHS, "training")
    m, n = x.shape[0], w_gate.shape[1]
    width = ell_width_for(ell_width, n)
    rows = _backup_rows(backup_capacity(m, backup_rows))      # summed over experts: known at run time only
    nu = n if w_up is not None else 0
    return (
        x.new_empty((m, w_down.shape[1])),
        x.new_empty((m,), dtype=torch.int32),
        x.new_empty((m, width), dtype=torch.int32),
        x.new_empty((m, width)),
        x.new_empty((m, width if w_up is not None else 0)),
        x.new_empty((rows,), dtype=torch.int64),
        x.new_empty((rows, n)),
        x.new_empty((rows, nu)),
        x.new_empty((w_gate.shape[0],), dtype=torch.int64),
    )


@torch.library.custom_op("twell::experts_train_bwd", mutates_args=(), tags=_TRAIN_TAGS)
def experts_train_bwd(dy: Tensor, x: Tensor, w_gate: Tensor, w_up: Optional[Tensor], w_down: Tensor,
                      offs: Tensor, counts: Tensor, cols: Tensor, ell_g: Tensor, ell_u: Tensor,
                      backup_idx: Tensor, backup_g: Tensor, backup_u: Tensor, backup_offs: Tensor,
                      l1_scale: float, act: str = "relu") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw_gate, dw_up, dw_down); dw_up is empty without w_up."""
    check_act(act, w_up is not None)
    dx, dwg, dwu, dwd = execute.experts_train_backward(dy, x, w_gate, w_up, w_down, offs, counts, cols, ell_g,
                                                       ell_u, backup_idx, backup_g, backup_u, backup_offs,
                                                       l1_scale, act)
    return dx, dwg, dwu if dwu is not None else x.new_empty(0), dwd


@experts_train_bwd.register_fake
def _(dy, x, w_gate, w_up, w_down, offs, counts, cols, ell_g, ell_u, backup_idx, backup_g, backup_u,
      backup_offs, l1_scale, act="relu"):
    check_act(act, w_up is not None)
    like = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    return like(x), like(w_gate), like(w_up) if w_up is not None else x.new_empty(0), like(w_down)


def _experts_setup_context(ctx, inputs: Sequence, output: Sequence) -> None:
    x, w_gate, w_up, w_down, offs = inputs[:5]
    ctx.save_for_backward(x, w_gate, w_up, w_down, offs, *output[1:])
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    ctx.y_shape = output[0].shape
    ctx.l1_scale = inputs[7]
    ctx.act = inputs[12] if len(inputs) > 12 else "relu"


def _experts_backward(ctx, dy: Optional[Tensor], *_unused: Optional[Tensor]):
    x, w_gate, w_up, w_down, offs, *saved = ctx.saved_tensors
    if dy is None:
        dy = x.new_zeros(ctx.y_shape)
    dx, dwg, dwu, dwd = torch.ops.twell.experts_train_bwd(dy, x, w_gate, w_up, w_down, offs, *saved, ctx.l1_scale,
                                                          ctx.act)
    need = ctx.needs_input_grad
    return (dx if need[0] else None, dwg if need[1] else None, dwu if w_up is not None and need[2] else None,
            dwd if need[3] else None, None, None, None, None, None, None, None, None, None, None)


experts_train.register_autograd(_experts_backward, setup_context=_experts_setup_context)


def arg_index(op: torch._ops.OpOverload, name: str) -> int:
    """Position of argument ``name`` in an op's schema (passes edit graph nodes by position)."""
    for i, a in enumerate(op._schema.arguments):
        if a.name == name:
            return i
    raise ValueError(f"{op} has no argument {name!r}")


def _train_setup_context(ctx, inputs: Sequence, output: Sequence) -> None:
    x, w_gate, b_gate, w_up, b_up, w_down, b_down, _w, _b, l1_scale = inputs[:10]
    ctx.save_for_backward(x, w_gate, b_gate, w_up, b_up, w_down, *output[1:])
    # The saved state is not differentiable, and eager autograd would still hand the backward
    # zero-filled grads for its float outputs ([M, N] each on the dense path: +368 MB at
    # M=16384): no materialised grads (AOTAutograd turns them off by itself).
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    ctx.y_shape = output[0].shape
    ctx.l1_scale = l1_scale
    ctx.act = inputs[15] if len(inputs) > 15 else "relu"
    ctx.has_b_down = b_down is not None


def _train_backward(ctx, dy: Optional[Tensor], *_unused: Optional[Tensor]):
    x, w_gate, b_gate, w_up, b_up, w_down, *saved = ctx.saved_tensors
    if dy is None:              # grads are not materialised (setup_context)
        dy = x.new_zeros(ctx.y_shape)
    grads = list(torch.ops.twell.ffn_train_bwd(dy, x, w_gate, b_gate, w_up, b_up, w_down, *saved, ctx.l1_scale,
                                               ctx.act, ctx.has_b_down))
    present = [True, True, b_gate is not None, w_up is not None, b_up is not None, True, ctx.has_b_down]
    out = [g if keep and need else None for g, keep, need in zip(grads, present, ctx.needs_input_grad)]
    return (*out, None, None, None, None, None, None, None, None, None, None, None)      # ell_width .. owner


ffn_train.register_autograd(_train_backward, setup_context=_train_setup_context)


__all__ = ["PATHS", "arg_index", "caller_modules", "declare", "mark_graphs", "experts_train", "experts_train_bwd",
           "ffn_train", "ffn_train_bwd", "next_instance", "experts_reason", "static_path", "static_reason", "tag",
           "tagged"]
