"""Eager decode calls replayed from the op's own CUDA graphs (host time per call).

An eager call of the decode path (no CUDA graph around the caller: torch.compile's default
mode, or plain eager use of the op) is host-bound: its kernels take 16-20 us of GPU time,
its Python launches, allocations and views most of the op's ~150 us (docs/inference.md "Host
time"). Here each (shapes, form, flags, weights) key is run eagerly once (Triton compiles and
loads its kernels), captured into a CUDA graph on the second call, and replayed from then on:
a copy of x into the graph's input, one replay, one clone of its output. The dense path at the
same sizes (eager's GEMMs, cuda_infer.dense_forward, statistics inside the graph) is graphed
likewise, and so are per-row calls whose GPU time is under their eager host time
(select.rows_host_bound); the dense and per-row graphs also read x and write y in place where
they come at a repeated address (``run``'s ``bind`` and ``out``: no copy, no clone).

Semantics are the eager call's: the output is a fresh tensor; the weights are read at replay
time, from the parameters themselves (no copies: updates made any way are seen);
a key holds every pointer the graph bakes in, so a new weight or statistics buffer captures a
new graph. Not used while the current stream is capturing (the caller's graph records the
kernels), nor under the Triton interpreter. The first capture per key synchronizes the device
once (like compiling). One stream at a time per layer, as for the persistent accumulator.
``TWELL_DECODE_GRAPHS=0`` turns it off at import; ``enabled(False)`` around a block, for a
while. Graphs share one memory pool per device; at most MAX_GRAPHS are kept (all dropped past
that).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch
from torch import Tensor

ENABLED = os.environ.get("TWELL_DECODE_GRAPHS", "1") != "0"
MAX_GRAPHS = 1024


class _Graph(NamedTuple):
    graph: Any            # torch.cuda.CUDAGraph
    x: Any                # the graph's input [M, K], or None where it reads x where it lies
    out: tuple            # the graph's outputs (y first, None where it writes the caller's y;
                          # the rest returned as they are)


class KeyGraphs:
    """One key's graphs by variant, (x's address or None: x copied into the graph's input,
    y's address or None: y copied out of the graph's output), and the choice a call makes
    among them (``choose``) from the addresses of the key's last call."""
    __slots__ = ("variants", "last_x", "last_y")

    def __init__(self) -> None:
        self.variants: dict[tuple, Any] = {}
        self.last_x: Any = None
        self.last_y: Any = None

    @property
    def bound(self) -> int:
        """Variants held that bind an address."""
        return sum(vk != (None, None) for vk in self.variants)

    def first(self, xa: Any, ya: Any) -> None:
        """The key's first call (run eagerly) came with these addresses."""
        self.last_x, self.last_y = xa, ya

    def choose(self, xa: Any, ya: Any) -> tuple[bool, tuple]:
        """(capture, variant) for a call whose x and y come at ``xa`` and ``ya`` (None: not
        bindable): the variant binding both where held; else, where x's or y's address repeats
        the last call's and fewer than MAX_BOUND variants bind, a new one binding what
        repeated (capture); else the held variant binding x, then y, then neither; else the
        copying variant (capture)."""
        v = self.variants
        if (xa, ya) in v:
            return False, (xa, ya)
        bx = xa if xa is not None and xa == self.last_x else None
        by = ya if ya is not None and ya == self.last_y else None
        self.last_x, self.last_y = xa, ya
        if (bx is not None or by is not None) and self.bound < MAX_BOUND and (bx, by) not in v:
            return True, (bx, by)
        for vk in ((xa, None), (None, ya), (None, None)):
            if vk in v:
                return False, vk
        return True, (None, None)


MAX_BOUND = 2                      # graphs per key that bind x's or y's address (``run``)
_entries: dict[tuple, KeyGraphs] = {}
_pools: dict[int, Any] = {}
_lock = threading.Lock()


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Within the block, op calls go through graphs only if ``on`` (process-wide, every thread;
    restored on exit). Cached plans follow: the switch is part of execute's plan-cache key.
    Graphs already captured stay held (``clear`` drops them)."""
    global ENABLED
    was = ENABLED
    ENABLED = bool(on)
    try:
        yield
    finally:
        ENABLED = was


def usable(x: Tensor) -> bool:
    """Whether calls on x may go through a graph: enabled, CUDA, not capturing already."""
    return ENABLED and x.is_cuda and not torch.cuda.is_current_stream_capturing()


def run(key: tuple, x: Tensor, fn: Callable[..., tuple], bind: bool = False,
        out: Optional[Tensor] = None) -> tuple:
    """``fn(x)`` (a tuple of tensors, y first), from a replay of its graph once captured.

    ``key`` must name everything ``fn`` bakes into its launches other than x's values and
    y's address: shapes, flags, and the addresses of every weight, bias and buffer it reads or
    writes. The y returned is a fresh tensor; the other outputs are the graph's own buffers
    (overwritten by the key's next call).

    ``bind``: where x comes at the address of the key's previous call (a compiled model's
    activations do, call after call), a graph reading x where it lies is replayed without the
    copy into its input (8 MB at 2048 tokens of width 2048 in bf16). ``out``: y freshly
    allocated by the caller, and ``fn(x, y_or_None)`` writes y there when given one: where
    ``out`` comes at the address of the key's previous call's (the allocator hands a freed y's
    block back), a graph writing y where it lies is replayed and ``out`` returned, without the
    clone of the graph's y (a launch, and M x K_out elements copied). A graph binds what
    repeated when it was captured; at most MAX_BOUND such graphs per key, other calls take the
    key's copying graph. No graph holds a bound x or y (their blocks stay the allocator's)."""
    e = _entries.get(key)
    xa = (x.data_ptr(), x.stride()) if bind else None
    ya = out.data_ptr() if out is not None else None
    if e is not None:
        with _lock:
            capture, vk = e.choose(xa, ya)
        if capture:
            return _capture(key, e, vk, x, fn, out)
        return _replay(e.variants[vk], x, vk[0], vk[1], out)
    with _lock:                     # first call: eager (compiles and loads the kernels)
        if len(_entries) >= 4 * MAX_GRAPHS:      # keys that never came back (fresh weights)
            for k in [k for k, v in _entries.items() if not v.variants]:
                del _entries[k]
        e = _entries.setdefault(key, KeyGraphs())
        e.first(xa, ya)
    return fn(x) if out is None else fn(x, out)


def _replay(g: _Graph, x: Tensor, xa: Any, ya: Any, out: Optional[Tensor]) -> tuple:
    if xa is None:
        g.x.copy_(x)
    g.graph.replay()
    return (out if ya is not None else _fresh(g.out[0], out),) + g.out[1:]


def _fresh(y: Tensor, out: Optional[Tensor]) -> Tensor:
    """The graph's y as a fresh tensor: copied into the caller's ``out`` where given (its block
    is then the caller's, not freed to come back at the next call as a repeat), else cloned."""
    return y.clone() if out is None else out.copy_(y)


def _capture(key: tuple, e: KeyGraphs, variant: tuple, x: Tensor, fn: Callable[..., tuple],
             out: Optional[Tensor]) -> tuple:
    bx, by = variant
    dev = x.device
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    graph = torch.cuda.CUDAGraph()
    pool = _pools.get(idx)
    if pool is None:
        pool = _pools.setdefault(idx, torch.cuda.graph_pool_handle())
    cur = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            # the input buffer comes from the graph's pool too: allocated before the capture,
            # it came from whatever pool the thread allocated to, and in a cudagraph tree's
            # warm-up (a recompile under reduce-overhead) that is Inductor's, which then fails
            # its check "Detected 16 tensor(s) in the cudagraph pool not tracked as outputs"
            # (generate() after a cache-length recompile)
            if bx is not None:                   # read where it lies: the variant holds its address
                xs = x
            else:
                with torch.inference_mode(False):   # copied into at every replay, in any mode
                    xs = torch.empty(x.shape, dtype=x.dtype, device=dev)
            res = tuple(fn(xs) if out is None else fn(xs, out if by is not None else None))
        finally:
            graph.capture_end()
    cur.wait_stream(side)
    if bx is None:
        xs.copy_(x)
    g = _Graph(graph, None if bx is not None else xs, ((None,) if by is not None else res[:1]) + res[1:])
    with _lock:
        if count() >= MAX_GRAPHS:
            _drop()
            e.variants.clear()
            _entries[key] = e
        e.variants[variant] = g
    graph.replay()
    return (out if by is not None else _fresh(res[0], out),) + res[1:]


def count() -> int:
    """Graphs held, over every key (a capture's bound, and tests)."""
    return sum(len(e.variants) for e in list(_entries.values()))


def bindings() -> list[tuple[bool, bool]]:
    """(reads x where it lies, writes y where it lies) of every graph held (for tests)."""
    return [(vx is not None, vy is not None) for e in list(_entries.values()) for vx, vy in list(e.variants)]


def _drop() -> None:
    # the pools go too: a pool whose graphs are all gone is released by PyTorch's allocator,
    # and capturing into its stale handle fails an internal assert
    _entries.clear()
    _pools.clear()


def clear() -> None:
    """Drop every graph (their pool memory is freed once nothing else holds it)."""
    with _lock:
        _drop()


# the getters behind torch.backends.cuda.matmul's flags (TF32, fp32 precision, reduced-precision
# reductions with their split-K halves, fp16 accumulation): called directly, one C call each
# instead of the module's Python __getattr__; a getter this torch lacks is left out
_MATH_GETTERS = tuple(f for f in (getattr(torch._C, name, None) for name in (
    "_get_cublas_allow_tf32", "_get_cublas_allow_bf16_reduced_precision_reduction",
    "_get_cublas_allow_fp16_reduced_precision_reduction", "_get_cublas_allow_fp16_accumulation"))
    if f is not None)
_FP32_PRECISION = getattr(torch._C, "_get_fp32_precision_getter", None)


def math_mode() -> tuple:
    """The settings cuBLAS calls read at capture time (a graph keeps them): every flag of
    torch.backends.cuda.matmul, and autocast."""
    fp32 = _FP32_PRECISION("cuda", "matmul") if _FP32_PRECISION is not None else None
    return (tuple(f() for f in _MATH_GETTERS), fp32, torch.is_autocast_enabled("cuda"),
            torch.get_autocast_dtype("cuda"))


def weights_key(*ts) -> tuple:
    """Address, shape and strides of each tensor (None kept): what a graph bakes in of them."""
    return tuple(None if t is None else (t.data_ptr(), t.shape, t.stride()) for t in ts)
