"""Chooses the kernel for each op call by device, dtype and shape.

Inference: CUDA tensors go to ``kernels/cuda_infer.py`` (TwELL kernels or eager's dense calls,
per ``kernels/cuda_policy.py``); CPU fp32/bf16 tensors to the C++ kernel (``kernels/cpu_ffn.py``);
training ops on CUDA bf16/fp16 to ``kernels/cuda_train.py``; everything else to the exact
plain-PyTorch implementations in ``kernels/torch_impl.py``. ``static_dense_reason`` answers at compile time
whether an inference call would surely run dense. Decisions use shapes, dtypes and devices, and
values only through device-side or lagged counts: never a host sync on the call path.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from twell_compile.kernels import cuda_policy, torch_impl


def _sym_lt(m: torch.SymInt, limit: int) -> Optional[bool]:
    """m < limit for a backed SymInt token count: from its value range where that decides it
    (no guard); else guarded (the graph then serves that side only) when every symbol in m is
    unbounded above; else None. A finite bound is a user's range (mark_dynamic(min=, max=)),
    which a narrowing guard would turn into a ConstraintViolationError."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    from torch.utils._sympy.numbers import int_oo

    if statically_known_true(m < limit):
        return True
    if statically_known_true(m >= limit):
        return False
    env = m.node.shape_env
    if any(env.var_to_range.get(s) is None or env.var_to_range[s].upper != int_oo
           for s in m.node.expr.free_symbols):
        return None
    return bool(m < limit)


def _cuda_infer(x: Tensor):
    """The CUDA inference implementation (kernels/cuda_infer.py) for CUDA tensors, else None.

    Any CUDA dtype goes there: it runs TwELL kernels for bf16/fp16 where the shape rule and
    the layer's measured density allow (see kernels/cuda_policy.py), eager's dense calls
    otherwise. Without Triton it stays on torch_impl.
    """
    if not x.is_cuda:
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from twell_compile.kernels import cuda_infer

    return cuda_infer


def _cpu_infer(x: Tensor, w_gate: Tensor, w_down: Tensor):
    """The C++ CPU implementation (kernels/cpu_ffn.py) for fp32/bf16 CPU tensors, else None.

    Tiny FFNs (under ``cpu_ffn.MIN_WORK`` multiply-adds) stay on torch_impl: faster there.
    It decides sparse vs dense inside the kernel from the non-zeros it counts (docs/cpu.md).
    If the extension cannot be built it warns once and this returns None (torch_impl runs);
    ``cpu_ffn.active_impl()`` reports which one is active.
    """
    if x.device.type != "cpu":
        return None
    from twell_compile.kernels import cpu_ffn

    return cpu_ffn if cpu_ffn.supports(x, w_gate, w_down) else None


def static_dense_reason(device: torch.device, dtype: torch.dtype, m: Optional[Union[int, torch.SymInt]], k: int,
                        n: int, k_out: int, cudagraphs: bool = True) -> Optional[str]:
    """Why the inference op would surely run dense for these compile-time shapes, or None.

    CUDA only, and only from facts fixed at compile time: the CUDA shape
    rule (kernels/cuda_policy.py) sends fp32, token counts between the decode path's maximum
    and the per-row path's minimum, and very wide layers at prefill sizes to eager's dense
    calls, which are slower than letting Inductor compile the FFN (per-call host overhead:
    0.35x of Inductor on a 30M-parameter model at 4096 tokens, H200, docs/training.md).
    Decode-sized M (<= DECODE_MAX_M) is rewritten where the decode rule can pick the decode
    path (its cost model at density 0, the best case) and ``cudagraphs`` says the graph runs in
    CUDA graphs: there the step is host-bound, and with the decode FFNs rewritten generate() ran
    0.63x of Inductor's tokens/s at batch 1 (7.9 vs 5.0 ms per step, H200, default mode,
    results/h200/session11/run9/), although one eager call of the op alone now costs less host
    time than Inductor's compiled FFN (75-112 vs 92-128 us at M=1-16, bench_host.py, session11/run7).

    A dynamic M (SymInt with a hint) is answered as its hint is, under guards for the hint's
    range (M <= DECODE_MAX_M, the band, M >= MIN_TOKENS): the graph serves that range only and
    a count in another range recompiles once (a user's mark_dynamic range is never narrowed:
    see _sym_lt). Measured with the decode range rewritten
    unguarded (session 16 run 4, bench_dynamic.py --inference, H200, default mode): 16 dynamic
    tokens ran the op at 183 us against Inductor's 124 (no CUDA graphs). Unbacked counts are
    rewritten.
    """
    if device.type != "cuda":
        return None
    from twell_compile.kernels import cuda_policy as cp

    if dtype not in cp.DTYPES:
        return f"{str(dtype).replace('torch.', '')} on CUDA runs dense (the sparse kernels take bf16/fp16)"
    if isinstance(m, torch.SymInt):
        decode = _sym_lt(m, cp.DECODE_MAX_M + 1) if m.node.has_hint() else None
        band = _sym_lt(m, cp.MIN_TOKENS) if decode is False else False
        if decode is None or band is None:
            return None                  # unbacked, or a user's range spans two ranges: the op decides
        where = (f"<= {cp.DECODE_MAX_M}" if decode else f"{cp.DECODE_MAX_M + 1}-{cp.MIN_TOKENS - 1}" if band
                 else f">= {cp.MIN_TOKENS}")
        return _guarded(m, where, _count_reason(cp, int(m.node.hint), k, n, k_out, cudagraphs))
    return None if m is None else _count_reason(cp, m, k, n, k_out, cudagraphs)


def _guarded(m: torch.SymInt, where: str, why: Optional[str]) -> Optional[str]:
    """A static count's reason, told for a dynamic count whose graph is guarded to ``where``."""
    return why and (f"dynamic token count {m}, {int(m.node.hint)} now; this graph is guarded to {where} "
                    f"tokens (another range recompiles once): {why}")


def _count_reason(cp, m: int, k: int, n: int, k_out: int, cudagraphs: bool) -> Optional[str]:
    """static_dense_reason's rules on a static token count (CUDA, bf16/fp16)."""
    if cp.DECODE_MAX_M < m < cp.MIN_TOKENS:
        return (f"{m} tokens: above the decode path's {cp.DECODE_MAX_M} and below the per-row path's "
                f"{cp.MIN_TOKENS}, where the CUDA sparse kernels lose to dense")
    if 1 <= m <= cp.DECODE_MAX_M and not cudagraphs:
        return (f"{m} tokens without CUDA graphs: the step is host-bound, and with these FFNs "
                f"rewritten generate() ran 0.63x of Inductor's speed at batch 1 (H200); compile with "
                f"mode='reduce-overhead', or set twell.cudagraphs='on' if you capture CUDA graphs yourself")
    if 1 <= m <= cp.DECODE_MAX_M and not cp.decode_wins(0.0, m, k, n, k_out, True):
        return (f"{m} tokens: the CUDA decode path's cost model (measured on H200) has dense "
                f"faster for this layer even at density 0")
    if m >= cp.MIN_TOKENS and (k > cp.MAX_WIDTH or k_out > cp.MAX_WIDTH or n > cp.MAX_N):
        return f"layer too wide for the CUDA sparse kernels (K={k}, K_out={k_out}, N={n})"
    if m >= cp.MIN_TOKENS and k < cp.MIN_WIDTH:
        return (f"K={k}: below the {cp.MIN_WIDTH} where the CUDA per-row kernels beat dense at "
                f"{m} tokens (measured on H200)")
    return None


def static_dense_train_reason(device: torch.device, dtype: torch.dtype, m: Optional[Union[int, torch.SymInt]],
                              k: int, n: int, k_out: int) -> Optional[str]:
    """Why the training op would surely run a path slower than Inductor's dense FFN for these
    compile-time facts, or None. CUDA only (the CPU keeps the rewrite: tests and the recipe
    run there). The pass asks only when no L1 penalty is set (the penalty lives in our
    backward, so such an FFN is always rewritten).

    H200 (docs/training-design.md): the CUDA training path's dense branch runs 0.73-0.81x of
    eager at 16k-64k tokens and 0.23-0.45x at 1024; fp32 and very wide layers train on the
    plain-PyTorch path (host syncs). Only a token count >= cuda_train.MIN_TOKENS of bf16/fp16
    within the kernels' widths can reach the sparse branch.

    ``m`` is the token count: an int when static, a SymInt under dynamic shapes, None when
    unknown. A SymInt with a hint under MIN_TOKENS is answered like a static count, and the
    answer is guarded (``m < MIN_TOKENS`` joins the graph's guards): at 1024 dynamic tokens
    the rewritten step ran 1644 us against Inductor's 745 (H200, session16/run1), so this graph
    serves small counts through Inductor and the first count >= MIN_TOKENS recompiles once,
    rewritten (guarded ``m >= MIN_TOKENS``). Unbacked counts, and a user's range spanning
    MIN_TOKENS, keep the rewrite.
    """
    if device.type != "cuda":
        return None
    from twell_compile.kernels import cuda_policy as cp
    from twell_compile.kernels import cuda_train as ct

    if dtype not in cp.DTYPES:
        return (f"{str(dtype).replace('torch.', '')} training on CUDA runs the plain-PyTorch path "
                f"(the sparse training kernels take bf16/fp16, e.g. under autocast)")
    if k > cp.MAX_WIDTH or k_out > cp.MAX_WIDTH or n > cp.MAX_N:
        return f"layer too wide for the CUDA sparse training kernels (K={k}, K_out={k_out}, N={n})"
    def below(count: int) -> str:
        return (f"{count} tokens: below the {ct.MIN_TOKENS} where the CUDA sparse training kernels "
                f"can win (no twell.l1 penalty needs our backward)")

    if isinstance(m, torch.SymInt):
        # guarded either way; None: unbacked, or a user's range spanning MIN_TOKENS
        if m.node.has_hint() and _sym_lt(m, ct.MIN_TOKENS):
            return _guarded(m, f"< {ct.MIN_TOKENS}", below(int(m.node.hint)))
        return None
    return below(m) if m is not None and m < ct.MIN_TOKENS else None


def ffn_infer(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
              b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
              tile_n: int, slots: int, layer: str, keep_stats: bool, instance: int = 0) -> Tensor:
    """``instance``: the op instance (ops.next_instance); the CUDA policy's state is its own."""
    cuda = _cuda_infer(x)
    if cuda is not None:
        prev = cuda_policy.enter(instance)
        try:
            return cuda.ffn_infer(x, w_gate, b_gate, w_up, b_up, w_down, b_down, tile_n, slots, layer, keep_stats)
        finally:
            cuda_policy.enter(prev)
    cpu = _cpu_infer(x, w_gate, w_down)
    if cpu is not None:
        return cpu.ffn_infer(x, w_gate, b_gate, w_up, b_up, w_down, b_down, layer, keep_stats)
    return torch_impl.ffn_infer(x, w_gate, b_gate, w_up, b_up, w_down, b_down, layer, keep_stats)


def _cuda_train(x: Tensor, w_gate: Tensor, w_down: Tensor):
    """The CUDA training implementation (kernels/cuda_train.py) for bf16/fp16 CUDA tensors
    within its widths, else None (fp32 and CPU run torch_impl). Needs Triton."""
    if not x.is_cuda:
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from twell_compile.kernels import cuda_train

    return cuda_train if cuda_train.supports(x, w_gate, w_down) else None


def ffn_train_forward(x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                      b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
                      ell_width: int, backup_rows: int, layer: str, keep_stats: bool,
                      instance: int = 0) -> tuple[Tensor, ...]:
    cuda = _cuda_train(x, w_gate, w_down)
    if cuda is None:
        return torch_impl.ffn_train_forward(x, w_gate, b_gate, w_up, b_up, w_down, b_down,
                                            ell_width, backup_rows, layer, keep_stats)
    prev = cuda_policy.enter(instance)          # as in ffn_infer
    try:
        return cuda.ffn_train_forward(x, w_gate, b_gate, w_up, b_up, w_down, b_down,
                                      ell_width, backup_rows, layer, keep_stats)
    finally:
        cuda_policy.enter(prev)


def reset() -> None:
    """Forget the runtime state of every op instance (the CUDA policy's measurements and the
    training path's last-path record); ``torch._dynamo.reset()`` calls this through the
    backend."""
    import sys

    cuda_policy.reset()
    train = sys.modules.get("twell_compile.kernels.cuda_train")
    if train is not None:
        train.last_sparse.clear()


def ffn_train_backward(dy: Tensor, x: Tensor, w_gate: Tensor, *args, **kwargs):
    impl = _cuda_train(x, w_gate, args[3]) or torch_impl
    return impl.ffn_train_backward(dy, x, w_gate, *args, **kwargs)
