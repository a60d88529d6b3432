"""The paths an FFN op can run, and what each one can take: one capability table.

``Path`` names every path (its values are the strings ``twell.path`` and the ops' ``path``
argument take). ``TABLE`` maps each to a ``PathRow``: per op (inference, training) a ``Caps``
record of the devices, dtypes, gated forms, widths and token counts its kernels take and what
they need. select.py's per-call plans (``plan_infer``, ``plan_train``), its compile-time rules
(``static_reason``, ``static_path``, ``decode_state_wanted``) and so ``explain``'s "runs"
column read their eligibility from these records through the functions below; a forced path
whose record refuses a call raises the reason ``refusal`` gives.

Thresholds measured per GPU stay in the records of arch.py: a row names the record field that
bounds it (``tokens_from``, ``min_width_from``, ``max_m_from``) and never holds its value. The
numbers in rows are the kernels' own limits (registers, 16-bit columns, row blocks).

A decode form is one row: a ``decode-<form>`` member of ``Path`` and its row with
``form="<form>"`` (``FORMS``, the forms the decode kernels run, and ``DETERMINISTIC_FORMS``
follow from the rows), plus the form's cost terms (select.decode_terms) and constants (the
records' ``decode_forms``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.util
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional

import torch

from twell_compile.runtime.arch import MAX_M, next_pow2


class Path(str, enum.Enum):
    """A path of the FFN ops; the value is the string users pass (``twell.path="decode-rows"``).
    Members compare equal to their strings."""

    AUTO = "auto"                  # the measured rules choose (select.py)
    DENSE = "dense"                # eager's calls (inference); eager's GEMMs saving g and u (training)
    TWELL = "twell"                # the per-row TwELL kernels (inference); the sparse training kernels
    DECODE = "decode"              # the decode kernels, form by the cost model
    DECODE_ROWS = "decode-rows"
    DECODE_TILES = "decode-tiles"
    DECODE_LIST = "decode-list"
    DECODE_PAIRS = "decode-pairs"
    DECODE_UNION = "decode-union"
    DECODE_UNION2 = "decode-union2"
    CPU = "cpu"                    # the C++ CPU kernel
    TORCH = "torch"                # plain PyTorch (torch_impl.py)
    COMPACT = "compact"            # training: eager's GEMMs saving the compact hybrid state

    def __str__(self) -> str:
        return self.value


class Need(str, enum.Enum):
    """What a path's kernels need present (``Caps.needs``) or use where present (``Caps.uses``)."""

    TRITON = "Triton"
    CPU_KERNEL = "its C++ extension built (csrc/cpu_ffn.cpp, on first use)"
    GATE_EXTENSION = "the CUDA gate extension (csrc/gate_pack*.cu, where the record names a gate_cfg)"
    DECODE_STATE = "a registered decode state (decode_state.register; else a zero-filled one per call)"
    OP_GRAPH = "the op's own CUDA graph (decode_graphs.py, where the record's rules ask for it)"

    def __str__(self) -> str:
        return self.value


DTYPES = (torch.bfloat16, torch.float16)      # the CUDA sparse kernels' dtypes
CPU_DTYPES = (torch.float32, torch.bfloat16)  # the C++ CPU kernel's
MAX_WIDTH = 8192        # K and K_out of the per-row and training kernels (a row in registers)
MAX_N = 65536           # hidden units: the per-row lists pack the column in 16 bits
MAX_LIST_SLOTS = 2 ** 31   # M x pow2(W) below this: the sparse backward's counting sort codes an
                           # entry as row * pow2(W) + slot in 32 bits and ranks entries in int32
ANY_GATING = frozenset((True, False))
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Caps:
    """What one path of one op takes. Empty or zero fields bound nothing.

    what: how messages name the kernels. runs: the plan path its launcher is given (select.py's
    InferPlan / TrainPlan). devices: x's device types. dtypes: x's dtypes (None:
    any). gated: the FFN forms it runs (True: gated, False: non-gated). needs: present or the
    path cannot run; uses: used where present. max_width: K and K_out at most; max_n: N at
    most; max_m: tokens at most; max_m_from: tokens at most this field of the record's decode
    config (``decode_config(M, K)``). nonzero: K, N and K_out at least 1. min_width_from and
    tokens_from (low, high): the record fields bounding K and the token count under "auto"
    (the low token bound is 1 where unnamed); graphs_tokens_from: the record field giving the
    low bound instead for calls inside CUDA graphs, where host time does not count (0 in the
    record: the same bound). backup: needs more tokens than dense-backup rows
    (a compact state). form: the decode form it forces ("" the cost model's). atomics: sums
    with atomics (not chosen by "auto" under torch.use_deterministic_algorithms). max_slots:
    tokens x the list width (to a power of 2) below this (``lists_fit``)."""

    what: str
    runs: str = ""
    devices: frozenset = frozenset()
    dtypes: Optional[tuple] = None
    gated: frozenset = ANY_GATING
    needs: frozenset = frozenset()
    uses: frozenset = frozenset()
    max_width: int = 0
    max_n: int = 0
    max_m: int = 0
    max_m_from: str = ""
    nonzero: bool = True
    min_width_from: str = ""
    tokens_from: tuple = ("", "")
    graphs_tokens_from: str = ""
    backup: bool = False
    form: str = ""
    atomics: bool = False
    max_slots: int = 0


@dataclass(frozen=True)
class PathRow:
    """A path's capabilities per op; None where the op has no such path."""

    inference: Optional[Caps]
    training: Optional[Caps]


_CUDA, _CPU = frozenset(("cuda",)), frozenset(("cpu",))
_RULES = Caps("path='auto'", nonzero=False)
_DENSE = Caps("the dense path", "dense", devices=_CUDA, needs=frozenset((Need.TRITON,)),
              uses=frozenset((Need.OP_GRAPH,)), nonzero=False)
_ROWS = Caps("the per-row path", "twell", devices=_CUDA, dtypes=DTYPES, needs=frozenset((Need.TRITON,)),
             uses=frozenset((Need.GATE_EXTENSION, Need.OP_GRAPH)), max_width=MAX_WIDTH, max_n=MAX_N,
             min_width_from="min_width", tokens_from=("min_tokens", ""), graphs_tokens_from="graphs_min_tokens")
_DECODE = Caps("the decode path", "decode", devices=_CUDA, dtypes=DTYPES, needs=frozenset((Need.TRITON,)),
               uses=frozenset((Need.DECODE_STATE, Need.OP_GRAPH)), max_m=MAX_M, tokens_from=("", "decode_max_m"))
_CPU_KERNEL = Caps("the C++ CPU kernel", "cpu", devices=_CPU, dtypes=CPU_DTYPES, needs=frozenset((Need.CPU_KERNEL,)),
                   min_width_from="min_width", tokens_from=("min_tokens", ""))
_TORCH = Caps("plain PyTorch", "torch", nonzero=False)
_TRAIN = Caps("the CUDA training kernels", "dense", devices=_CUDA, dtypes=DTYPES, needs=frozenset((Need.TRITON,)),
              max_width=MAX_WIDTH, max_n=MAX_N)
_TRAIN_COMPACT = dataclasses.replace(_TRAIN, runs="compact", backup=True, tokens_from=("train_min_tokens", ""),
                                     atomics=True)


def _form(form: str, atomics: bool, **limits) -> PathRow:
    return PathRow(dataclasses.replace(_DECODE, form=form, atomics=atomics, **limits), None)


TABLE: Mapping[Path, PathRow] = MappingProxyType({
    Path.AUTO: PathRow(_RULES, _RULES),
    Path.DENSE: PathRow(_DENSE, _TRAIN),
    Path.TWELL: PathRow(_ROWS, dataclasses.replace(_TRAIN_COMPACT, runs="twell", min_width_from="train_min_width",
                                                   max_slots=MAX_LIST_SLOTS)),
    Path.DECODE: PathRow(_DECODE, None),
    Path.DECODE_ROWS: _form("rows", True, max_m_from="vec_m"),
    Path.DECODE_TILES: _form("tiles", True),
    Path.DECODE_LIST: _form("list", False),
    Path.DECODE_PAIRS: _form("pairs", True),
    Path.DECODE_UNION: _form("union", True),
    Path.DECODE_UNION2: _form("union2", True),
    Path.CPU: PathRow(_CPU_KERNEL, None),
    Path.TORCH: PathRow(_TORCH, None),
    Path.COMPACT: PathRow(None, _TRAIN_COMPACT),
})

INFER_PATHS = tuple(p.value for p, row in TABLE.items() if row.inference is not None)
TRAIN_PATHS = tuple(p.value for p, row in TABLE.items() if row.training is not None)
PATHS = tuple(p.value for p in TABLE)
FORMS = tuple(row.inference.form for row in TABLE.values() if row.inference is not None and row.inference.form)
DETERMINISTIC_FORMS = tuple(row.inference.form for row in TABLE.values()
                            if row.inference is not None and row.inference.form and not row.inference.atomics)
DECODE_PATHS = tuple(p.value for p, row in TABLE.items()
                     if row.inference is not None and row.inference.runs == "decode")


def caps(path: str, training: bool) -> Caps:
    """The record of ``path`` for the training or the inference op (KeyError where it has none)."""
    row = TABLE[Path(path)]
    c = row.training if training else row.inference
    if c is None:
        raise KeyError(f"{path!r} is no {'training' if training else 'inference'} path")
    return c


def path_of(form: str) -> str:
    """The decode path that forces ``form``."""
    return next(p.value for p, row in TABLE.items() if row.inference is not None and row.inference.form == form)


# --------------------------------------------------------------------------- checks
@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def missing(need: Need) -> Optional[str]:
    """Why ``need`` is not present now, or None (the C++ CPU kernel: builds on first ask)."""
    if need is Need.TRITON:
        return None if triton_available() else "Triton is not installed"
    if need is Need.CPU_KERNEL:
        from twell_compile.runtime import cpu_ffn       # builds on first use; not at import

        if cpu_ffn.extension() is None:
            return f"the C++ CPU kernel must build, and did not ({cpu_ffn.active_impl()})"
        return None
    raise ValueError(f"{need!r} is used where present, not checked")


def have(need: Need) -> bool:
    return missing(need) is None


def runs_on(c: Caps, device_type: str) -> bool:
    return not c.devices or device_type in c.devices


def dtype_ok(c: Caps, dtype: torch.dtype) -> bool:
    return c.dtypes is None or dtype in c.dtypes


def too_wide(c: Caps, k: int, n: int, k_out: int) -> bool:
    """Whether K, K_out or N exceed the kernels' limits."""
    return bool((c.max_width and max(k, k_out) > c.max_width) or (c.max_n and n > c.max_n))


def fits_widths(c: Caps, k: int, n: int, k_out: int) -> bool:
    """The width rule: K, N and K_out at least 1 where the kernels need it, within their limits."""
    return (not c.nonzero or min(k, n, k_out) >= 1) and not too_wide(c, k, n, k_out)


def min_width(c: Caps, p) -> int:
    """The K the record ``p`` asks under "auto" (0: none)."""
    return getattr(p, c.min_width_from) if c.min_width_from else 0


def token_range(c: Caps, p, graphs: bool = False) -> tuple[int, Optional[int]]:
    """The token counts (low, high; None: no bound) the record ``p`` gives the path under "auto";
    ``graphs``: for a call inside a CUDA graph, where the row's ``graphs_tokens_from`` field,
    where set (non-zero) and lower, gives the low bound (host time does not count there)."""
    lo, hi = c.tokens_from
    low = getattr(p, lo) if lo else 1
    if graphs and c.graphs_tokens_from:
        low = min(low, getattr(p, c.graphs_tokens_from) or low)
    return low, (getattr(p, hi) if hi else None)


def lists_fit(c: Caps, m: int, width: int) -> bool:
    """Whether M rows of per-row lists of ``width`` slots fit the path's 32-bit entry codes."""
    return not c.max_slots or m * next_pow2(width) < c.max_slots


def in_range(c: Caps, p, m: int, graphs: bool = False) -> bool:
    lo, hi = token_range(c, p, graphs)
    return lo <= m and (hi is None or m <= hi)


def auto_ok(c: Caps, p, dtype: torch.dtype, m: int, k: int, n: int, k_out: int, graphs: bool = False) -> bool:
    """Whether "auto" may take the path for this call (device and needs aside): its dtypes and
    widths, and the record's K and token bounds (``graphs``: token_range's)."""
    return (dtype_ok(c, dtype) and fits_widths(c, k, n, k_out) and k >= min_width(c, p)
            and in_range(c, p, m, graphs))


def max_tokens(c: Caps, p, m: int, k: int) -> Optional[int]:
    """The most tokens the path's kernels take for a call of M rows of width K (None: any)."""
    limits = [c.max_m] if c.max_m else []
    if c.max_m_from:
        limits.append(getattr(p.decode_config(m, k), c.max_m_from))
    return min(limits) if limits else None


def dtype_names(c: Caps) -> str:
    """The record's dtypes, short ("bf16/fp16"; "" for any)."""
    return "/".join(_SHORT.get(d, str(d).replace("torch.", "")) for d in c.dtypes) if c.dtypes is not None else ""


def takes(c: Caps) -> str:
    """What the path takes, in words (``refusal``'s messages)."""
    dts = dtype_names(c)
    kinds = "/".join(d.upper() for d in sorted(c.devices))
    head = " ".join(s for s in (dts, kinds, "tensors" if dts or kinds else "calls") if s)
    parts = [f"{head} with {' and '.join(map(str, sorted(c.needs)))}" if c.needs else head]
    if c.max_width:
        parts.append(f"K and K_out <= {c.max_width}")
    if c.max_n:
        parts.append(f"N <= {c.max_n}")
    if c.max_m:
        parts.append(f"1-{c.max_m} tokens")
    return ", ".join(parts)


def refusal(c: Caps, device: torch.device, dtype: torch.dtype, m: int, k: int, n: int, k_out: int,
            p=None) -> Optional[str]:
    """Why the path of record ``c``, forced, cannot run this call (None: it can): x's device,
    a missing need, the dtype, a width, the token count (the kernels' limits; the record's
    measured bounds apply under "auto" only)."""
    got = f"(got {dtype}, {m} tokens, K={k}, K_out={k_out}, N={n})"
    take = f"{c.what} {'take' if c.what.endswith('s') else 'takes'} {takes(c)} {got}"
    if not runs_on(c, device.type):
        return f"x is on {device}: a {'/'.join(d.upper() for d in sorted(c.devices))} path ({c.what})"
    if not dtype_ok(c, dtype):
        return take
    for need in sorted(c.needs):
        why = missing(need)
        if why is not None:
            return f"x is on {device}, and {why}"
    if not fits_widths(c, k, n, k_out) or (c.max_m and not 1 <= m <= c.max_m):
        return take
    if c.max_m_from and m > max_tokens(c, p, m, k):
        return f"the {c.form} form takes up to {max_tokens(c, p, m, k)} tokens {got}"
    return None
