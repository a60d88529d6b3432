"""Triton launches with less host time: the compiled kernel's own launcher, cached per
specialization, instead of ``JITFunction.run``'s per-call argument binding.

``kernel[grid](...)`` of a 20-argument kernel costs 28.4 us of host time, the compiled
kernel's runner (``CompiledKernel[grid](*args, stream=...)``) 11.8 us (bench_host.py; Triton
3.6): at decode sizes two standard launches alone would make an eager call host-bound.

The cache key holds everything Triton specializes a kernel on: the constexpr values, the launch
options, the current device, every int argument's exact value (stronger than Triton's ==1 and
multiple-of-16 checks) and every tensor's dtype and address modulo 16. A key seen for the first
time goes through the standard launch, which compiles (or finds the kernel in Triton's cache)
and returns the compiled kernel kept for later calls. Under the Triton interpreter (CPU CI),
for kernels that are not plain ``@triton.jit`` functions, and when the environment sets
``TWELL_TRITON_LAUNCH=standard``, every call takes the standard launch.

Also the small host helpers every launcher shares: ``pow2``, ``warps_by_width``,
``unit_rows``, ``transposed``, ``pdl_ok`` and ``INTERPRET``.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Sequence

import torch
from torch import Tensor
from triton.runtime.jit import JITFunction

from twell_compile.kernels.transpose import transpose_kernel
from twell_compile.runtime.arch import next_pow2 as pow2  # the launchers' name for it

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"   # no inline PTX there

# Programmatic dependent launch (Hopper+): a launch may begin while the previous kernel in the
# stream finishes (the kernels wait on griddepcontrol before touching memory, kernels/pdl.py),
# hiding the launch latency between consecutive launches. TWELL_PDL=0 turns it off.
PDL = os.environ.get("TWELL_PDL", "1") != "0"
_pdl_devices: dict[int, bool] = {}


def pdl_ok(device: torch.device) -> bool:
    """Whether launches on ``device`` use programmatic dependent launch: PDL on, a CUDA device
    of compute capability >= 9.0, Triton with griddepcontrol (triton.language.extra.cuda.gdc_wait),
    not the interpreter. Cached per device."""
    if not PDL or INTERPRET or device.type != "cuda":
        return False
    i = device.index if device.index is not None else torch.cuda.current_device()
    ok = _pdl_devices.get(i)
    if ok is None:
        try:
            from triton.language.extra.cuda import gdc_wait  # noqa: F401
            has = True
        except ImportError:
            has = False
        ok = _pdl_devices[i] = has and torch.cuda.get_device_capability(i)[0] >= 9
    return ok


def warps_by_width(width: int, cols_per_warp: int) -> int:
    """Warps for a program holding rows of ``width`` columns: pow2(width) / cols_per_warp, >= 1."""
    return max(1, pow2(width) // cols_per_warp)


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 4 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 4
    return _sms(device.index if device.index is not None else torch.cuda.current_device())


def unit_rows(w: Tensor) -> Tensor:
    """A weight whose rows are gathered must have unit stride along K."""
    return w if w.stride(-1) == 1 else w.contiguous()


def transposed(w: Tensor, out: Tensor | None = None) -> Tensor:
    """w.t() contiguous, recomputed per call by ``transpose_kernel`` (PyTorch's own strided copy
    took 77 us at [2048, 5632] bf16 on the H200; this ~15 us of a ~1 ms call), into ``out``
    (contiguous [C, R]) when given.

    Made per call, never cached: a copy kept across calls goes stale when a weight changes
    without a version bump (``.data``); in a CUDA graph the transpose is replayed too.
    """
    wt = w.t()
    if wt.is_contiguous() and out is None:
        return wt
    r, c = w.shape
    if out is None:
        out = torch.empty((c, r), dtype=w.dtype, device=w.device)
    if w.numel():
        pdl = pdl_ok(w.device)
        launch(transpose_kernel, (-(-r // 64), -(-c // 64)), (w, out, r, c, w.stride(0), w.stride(1)),
               dict(BR=64, BC=64, PDL=pdl), num_warps=4, pdl=pdl)
    return out

_PLAIN = frozenset((int, float, bool, type(None)))
MAX_KEYS = 4096          # distinct specializations kept; cleared past this (an M seen per call)
_runners: dict[tuple, Any] = {}


def fast_enabled() -> bool:
    """Whether launches may skip JITFunction.run (read per call: tests and users may set the
    environment variable at any time)."""
    return os.environ.get("TWELL_TRITON_LAUNCH", "fast") != "standard"


def launch(kernel, grid: Sequence[int], args: Sequence[Any], consts: dict[str, Any],
           num_warps: int, num_stages: int | None = None, pdl: bool = False, maxnreg: int = 0) -> None:
    """``kernel[grid](*args, **consts, num_warps=num_warps, num_stages=num_stages)``.

    ``args``: the runtime arguments in signature order (tensors, ints, floats, None);
    ``consts``: every remaining parameter by name (the constexprs; the kernels here take no
    defaults). ``grid``: 1 to 3 ints. ``pdl``: launch with programmatic dependent launch
    (Triton's ``launch_pdl``; the kernel must wait on griddepcontrol before touching memory).
    ``maxnreg`` > 0: compiled to at most this many registers per thread (Triton's ``maxnreg``;
    the interpreter ignores it).
    """
    g = tuple(grid) + (1,) * (3 - len(grid))
    opts = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
    if pdl:
        opts["launch_pdl"] = True
    if maxnreg > 0:
        opts["maxnreg"] = maxnreg
    if type(kernel) is not JITFunction or not fast_enabled():
        _check_order(kernel, args, consts)      # (the interpreter's kernels too: CPU CI)
        kernel[g](*args, **consts, **opts)
        return
    dev = torch.cuda.current_device()
    cvals = tuple(consts.values())
    # (the constexprs' names are fixed by the signature: _check_order on the first launch)
    key = (id(kernel), dev, num_warps, num_stages, pdl, maxnreg, cvals,
           tuple([a if type(a) in _PLAIN else (a.dtype, a.data_ptr() & 15) for a in args]), g)
    runner = _runners.get(key)
    if runner is None:
        _check_order(kernel, args, consts)
        ck = kernel[g](*args, **consts, **opts)
        if len(_runners) >= MAX_KEYS:
            _runners.clear()
        _runners[key] = ck[g]
        return
    runner(*args, *cvals, stream=torch._C._cuda_getCurrentRawStream(dev))


def _check_order(kernel, args: Sequence[Any], consts: dict[str, Any]) -> None:
    """The fast launch passes ``(*args, *consts.values())`` positionally: the constexprs must
    follow the runtime arguments in the kernel's signature order."""
    names = getattr(kernel, "arg_names", None)
    if names is None:
        return
    if len(names) != len(args) + len(consts) or tuple(names[len(args):]) != tuple(consts):
        raise TypeError(f"{kernel}: pass the runtime arguments in order, then every constexpr by "
                        f"name in signature order ({names[len(args):]}); got {len(args)} "
                        f"positional and {list(consts)}")


def cached() -> int:
    """Number of specializations held (for tests)."""
    return len(_runners)


def clear() -> None:
    _runners.clear()

