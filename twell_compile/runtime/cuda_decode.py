"""Host side of the decode path (kernels/twell_decode.py): few tokens, bf16/fp16.

For x [M, K] with M <= MAX_M: ``decode_fused_kernel``, one program per neuron block: gate over
all of K, relu, the active set, then up/down for the active neurons only (W_up rows contiguous
in nn.Linear's [N, K] layout, W_down^T rows read through W_down's transposed view, strided,
never copied), one neuron at a time with whole-row loads ("rows", M <= cfg.vec_m) or as
tl.dot tiles, added into an fp32 accumulator by atomics; the row block's last program (ticket)
writes y, the statistics and zeroes the accumulator again. One launch per FFN when the weight
is registered (its persistent accumulator, ``decode_state.decode_state``) and the finish is
small (one row block, M x K_out <= cfg.finish_max); otherwise a zero-fill and/or a separate
finishing launch. No host sync, fixed launch shapes per M: CUDA-graph capturable. Exact at any
density: a neuron is skipped only where relu(g) is 0 and g finite in every row of its row block.

Measured on the H200 (K=2048, N=5632, M=1, d=0.005, CUDA graphs over 4 layers; dense 34.0 us;
docs/inference.md "Decode"): the rows form 14.9 us (2.28x of dense), the pairs form at M=16
28.2 us against dense 34.3 (benchmarks/results/h200/ffn_decode.json). An empty
launch costs 1.4 us in a graph. The list form (twell_decode_list.py) sums without atomics and
is the one used under torch.use_deterministic_algorithms. The union form
(twell_decode_union.py) reads each W_up and W_d^T row of the batch's union once for all rows,
on tensor cores: a first launch lists the union per neuron block with h, a second runs the
down projection over the list (forced only, ``path="decode-union"``). The union2 form
(twell_decode_union2.py) gates by one cuBLAS GEMM, lists the union, then runs up over chunks
of the compacted union and down over K_out tiles x splits of it, every row tile of M in the
same program (forced only, ``path="decode-union2"``: 29.3 / 56.4 / 88.2 / 224.1 us at M = 16 /
64 / 128 / 256 against the pairs form's 18.5 / 40.6 / 58.2 / 100.2, W_down stored transposed,
benchmarks/results/h200/ffn_decode_union2.json). Launches use
programmatic dependent launch on Hopper (``launch.pdl_ok``), and eager calls replay the op's own CUDA
graph (``execute(graphed=True)``, decode_graphs.py).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from twell_compile.kernels.twell_decode import decode_finish_kernel, decode_fused_kernel
from twell_compile.kernels.twell_decode_list import decode_gather_kernel, decode_pairs_kernel
from twell_compile.kernels.twell_decode_union import decode_union_down_kernel, decode_union_up_kernel
from twell_compile.kernels.twell_decode_union2 import (decode_union2_down_kernel, decode_union2_list_kernel,
                                                       decode_union2_up_kernel)
from twell_compile.reference import ACTS
from twell_compile.runtime import arch, decode_graphs, decode_state
from twell_compile.runtime.arch import MAX_M, MAX_MB, DecodeConfig, m_pad, m_pad_rows, pairs_bn, pairs_pb, rows_bn, rows_gemv
from twell_compile.runtime.launch import launch, pdl_ok, pow2
from twell_compile.runtime.paths import FORMS

FINISH_BLOCK = 1024   # accumulator elements per step of a finishing program
U2_TILES = 8          # union2 form: row tiles per program at most (its kernels' accumulators)
STAT_BLOCKS = 256     # neuron blocks per step of the list form's statistics sum


def config_for(m: int, k: int, device: torch.device) -> DecodeConfig:
    """The launch config for M rows of width K on ``device`` (its record's decode tables)."""
    return arch.launch_policy(device).decode_config(m, k)


class Decoded(NamedTuple):
    y: Tensor        # [M, K_out]
    tok: Tensor      # [M + 1] int32: non-zeros of relu(g) per token, then their total
    hsum: Tensor     # [1] fp32: sum |h|


def decode_forward(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                   b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
                   cfg: Optional[DecodeConfig] = None, stats_buf: Optional[Tensor] = None,
                   form: Optional[str] = None, graphed: bool = False, act: str = "relu") -> Decoded:
    """The FFN for x2 [M, K], M <= MAX_M. ``stats_buf``: a layer's float64 [4] statistics buffer
    (stats.py) that the kernels fill in place (sum and max of non-zeros per token, sum |h|, 0).
    ``form``: how up/down run: "rows" (one active neuron at a time, only for M <= cfg.vec_m),
    "tiles" (tl.dot tiles, atomics), "list" (per-token lists, a gather launch; no atomics) or
    "pairs" (per active pair, atomics) or "union" (the batch's union of active neurons listed,
    then one down launch over it: each weight row read once) or "union2" (the gate by cuBLAS,
    up and down over the compacted union, all rows per program); None: rows where M <=
    cfg.vec_m, else tiles (the plan decides by density, select.decode_form). ``cfg``: default
    config_for(M, K, device).
    ``graphed``: eager calls replay the op's own CUDA graph (``decode_graphs``; the op passes
    it); tok and hsum are then the graph's buffers, overwritten by the layer's next call.
    ``act``: the activation (reference.ACTS), formed where h is (kernels/act.py)."""
    m, k = x2.shape
    if m > MAX_M:
        raise ValueError(f"decode path takes M <= {MAX_M} rows, got x with {m}")
    if form not in (None,) + FORMS:
        raise ValueError(f"form must be one of {FORMS} or None, got {form!r}")
    if form in ("union", "union2") and x2.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"form={form!r} takes x2 in float16 or bfloat16 (its list holds h in x's dtype), "
                         f"got {x2.dtype}")
    if m == 0:
        dev = x2.device
        return Decoded(torch.empty((0, w_down.shape[0]), dtype=x2.dtype, device=dev),
                       torch.zeros(1, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.float32, device=dev))
    c = cfg or config_for(m, k, x2.device)
    if form is None:
        form = "rows" if m <= c.vec_m else "tiles"
    elif form == "rows" and m > c.vec_m:
        raise ValueError(f"form='rows' takes M <= cfg.vec_m = {c.vec_m} rows, got {m}")
    if cfg is not None:                 # a caller's config, checked before any device query
        if form == "union":             # (the records' configs are checked once, by prepare)
            _union_sizes(c)
        elif form == "union2":
            _union2_tiles(m, c)
    return execute(x2, w_gate, b_gate, w_up, b_up, w_down, b_down, form, stats_buf, c, graphed, act)


class U2Split(NamedTuple):
    """The union2 up launch's K splits: per-call int32 tickets (one per chunk and row group) and
    fp32 partials (elements)."""
    tickets: int
    partials: int


class Prepared(NamedTuple):
    """The host arithmetic of a decode call, fixed by its shapes, form and flags (``prepare``):
    per-call buffer sizes, and per launch the kernel, grid, static int arguments, constexprs,
    warps and stages. Holds no tensors, so ``execute`` keeps these in a plain dict."""
    int_sizes: tuple         # int32 scratch: list neurons, list counts, non-zeros per block row, tok
    int_total: int
    float_sizes: tuple       # fp32 scratch: list h (union form: h in x's dtype, 2 per word), sum |h| per block, total
    float_total: int
    launch1: tuple           # (kernel, grid, static ints, constexprs, warps, stages)
    launch2: Optional[tuple]  # the same for the finishing / gather / down launch (None: in-kernel finish)
    launch3: Optional[tuple] = None   # union: its finishing launch (None: its down launch writes y); union2: its down launch
    launch4: Optional[tuple] = None   # union2: its finishing launch (None: its down launch writes y)
    uses_acc: bool = True    # the launches add into the fp32 accumulator (else a fresh state is its tail alone)
    split: Optional[U2Split] = None   # union2 with cfg.u2_sk > 1: its tickets and partials


def prepare(m: int, k: int, n: int, k_out: int, form: str, c: DecodeConfig, gated: bool, has_bg: bool,
            has_bu: bool, has_bd: bool, has_stats: bool, clean: bool, pdl: bool = False,
            act: str = "relu") -> Prepared:
    """``clean``: the accumulator is a registered weight's persistent one (zero between calls).
    ``pdl``: launch with programmatic dependent launch (``pdl_ok``)."""
    if form == "union":
        return _prepare_union(m, k, n, k_out, c, gated, has_bg, has_bu, has_bd, has_stats, clean, pdl, act)
    if form == "union2":
        return _prepare_union2(m, k, n, k_out, c, gated, has_bu, has_bd, has_stats, clean, pdl, act)
    mb = min(m_pad(m), MAX_MB)
    nrb = -(-m // mb)
    lists = form in ("list", "pairs")
    gemv = form == "rows" and rows_gemv(m, c)
    pairs = form == "pairs"
    bn = pairs_bn(c) if pairs else c.lbn if lists else rows_bn(m, c) if form == "rows" else c.bn
    nb = -(-n // bn)
    nl = m * n if form == "list" else 0
    # int32: (list form: neuron indices [M, N], counts per (token, block) [M, NB], non-zeros
    # per (row block, block, row)), tok [M + 1]; fp32: (list form: h [M, N], sum |h| per
    # block), total. The other forms add their statistics into the state's counters.
    per_block = form == "list"
    int_sizes = (nl, m * nb if per_block else 0, nrb * nb * mb if per_block else 0, m + 1)
    float_sizes = (nl, nrb * nb if per_block else 0, 1)
    finish = _finish(m, k_out, has_bd, clean, has_stats, pdl)
    p2 = lambda v: min(v, max(16, pow2(k)))  # noqa: E731  (a K step: at most K padded)
    if lists:
        launch1 = (decode_pairs_kernel, (nb, nrb), (m, k, n, nb, k_out), dict(
            GATED=gated, HAS_BG=has_bg, HAS_BU=has_bu, MB=mb, BN=bn, BK=p2(c.lbk or c.bk),
            PB=pairs_pb(c) if pairs else c.pb,
            KC=p2(c.kc), UDOT=c.udot, BKU=p2(c.bku), ADOWN=form == "pairs",
            KOC=min(c.koc, max(16, pow2(k_out))), PDL=pdl, ACT=ACTS.index(act)),
            (c.pwarps or c.warps) if pairs else c.warps, c.lstages or c.stages)
        if form == "pairs":
            launch2 = finish
        else:
            bo = min(c.bo, max(16, pow2(k_out)))
            no = -(-k_out // bo)
            launch2 = (decode_gather_kernel, (m * no + 1,), (m, n, k_out, nb, no, nrb), dict(
                HAS_BD=has_bd, HAS_ST=has_stats, MB=mb, BN=c.lbn, NBP=max(16, pow2(nb)), LE=c.le,
                BO=bo, RB=STAT_BLOCKS, PDL=pdl), c.gwarps, None)
    else:
        fin = nrb == 1 and m * k_out <= c.finish_max
        ms = m_pad_rows(m) if form == "rows" else 0     # rows of the per-neuron up/down path
        launch1 = (decode_fused_kernel, (nb, nrb), (m, k, n, k_out), dict(
            GATED=gated, HAS_BG=has_bg, HAS_BU=has_bu, HAS_BD=has_bd, FINISH=fin, CLEAN=clean,
            HAS_ST=has_stats, MB=mb, BN=bn, BK=p2(c.bk), BKU=p2(c.bku),
            BKO=min(c.bko, max(16, pow2(k_out))), MS=ms, KP=pow2(k) if ms else 1,
            KOP=pow2(k_out) if ms else 1, FB=FINISH_BLOCK, CB=pow2(m), GEMV=gemv, PDL=pdl, ACT=ACTS.index(act)),
            c.warps, c.stages)
        launch2 = None if fin else finish
    return Prepared(int_sizes, sum(int_sizes), float_sizes, sum(float_sizes), launch1, launch2)


def _finish(m: int, k_out: int, has_bd: bool, clean: bool, has_stats: bool, pdl: bool) -> tuple:
    """The finishing launch (y from the accumulator, bias, statistics; the accumulator zeroed
    where ``clean``) of every form that adds into the accumulator."""
    return (decode_finish_kernel, (-(-(m * k_out) // FINISH_BLOCK) + 1,), (m, k_out), dict(
        HAS_BD=has_bd, CLEAN=clean, HAS_ST=has_stats, BLOCK=FINISH_BLOCK, CB=pow2(m), PDL=pdl), 4, None)


def _check_fields(c: DecodeConfig, pow2_fields: tuple, zero_or_pow2: str, splits: str) -> None:
    """Raises ValueError naming the field of ``c`` that a union form's kernels cannot take:
    ``pow2_fields`` powers of two >= 16, ``zero_or_pow2`` 0 or such a power, ``splits`` >= 1."""
    for name in pow2_fields:
        v = getattr(c, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"cfg.{name} must be a power of two >= 16, got {v}")
    v = getattr(c, zero_or_pow2)
    if v and (v < 16 or v & (v - 1)):
        raise ValueError(f"cfg.{zero_or_pow2} must be 0 or a power of two >= 16, got {v}")
    if getattr(c, splits) < 1:
        raise ValueError(f"cfg.{splits} must be >= 1, got {getattr(c, splits)}")


def _union_sizes(c: DecodeConfig) -> None:
    """Raises ValueError for union fields of ``c`` that the kernels cannot take."""
    _check_fields(c, ("union_bn", "union_bk", "union_bo", "union_c"), "union_mb", "union_s")


def _prepare_union(m: int, k: int, n: int, k_out: int, c: DecodeConfig, gated: bool, has_bg: bool,
                   has_bu: bool, has_bd: bool, has_stats: bool, clean: bool, pdl: bool, act: str) -> Prepared:
    """``prepare`` for the union form: the list launch over N / union_bn blocks, the down launch
    over K_out / union_bo tiles x union_s splits x row tiles, and the finish unless union_s is 1
    (then the down launch writes y and reads the counters)."""
    _union_sizes(c)
    bn = c.union_bn
    nb = -(-n // bn)
    mp = max(16, pow2(m))                        # rows of every tile: all M at once
    mt = min(mp, c.union_mb) if c.union_mb else mp
    bo = min(c.union_bo, max(16, pow2(k_out)))
    no = -(-k_out // bo)
    direct = c.union_s == 1
    # int32: list neurons [NB * BN] (slots), counts per block [NB], -, tok [M + 1]; fp32 words:
    # list h [NB * BN, M_P] in x's dtype (2 bytes: half a word each), -, total
    int_sizes = (nb * bn, nb, 0, m + 1)
    float_sizes = (nb * bn * mp // 2, 0, 1)
    p2 = lambda v: min(v, max(16, pow2(k)))  # noqa: E731  (a K step: at most K padded)
    launch1 = (decode_union_up_kernel, (nb,), (m, k, n), dict(
        GATED=gated, HAS_BG=has_bg, HAS_BU=has_bu, BN=bn, MP=mp, BK=p2(c.union_bk), PDL=pdl, ACT=ACTS.index(act)),
        c.union_warps, c.union_stages)
    launch2 = (decode_union_down_kernel, (no, c.union_s, mp // mt), (m, k_out, nb), dict(
        DIRECT=direct, HAS_BD=has_bd, HAS_ST=has_stats, BN=bn, MP=mp, MT=mt, NBP=max(16, pow2(nb)), BO=bo,
        C=c.union_c, CB=pow2(m), PDL=pdl), c.union_dwarps, c.union_dstages)
    launch3 = None if direct else _finish(m, k_out, has_bd, clean, has_stats, pdl)
    return Prepared(int_sizes, sum(int_sizes), float_sizes, sum(float_sizes), launch1, launch2, launch3,
                    uses_acc=not direct)


def _union2_tiles(m: int, c: DecodeConfig) -> tuple[int, int, int]:
    """(rows per tl.dot tile, row tiles per up program, row tiles per down program) of the union2
    form for M rows; ValueError for union2 fields of ``c`` the kernels cannot take."""
    _check_fields(c, ("u2_bl", "u2_c", "u2_bk", "u2_mt", "u2_bo", "u2_cd"), "u2_mr", "u2_s")
    if c.u2_sk < 1:
        raise ValueError(f"cfg.u2_sk must be >= 1, got {c.u2_sk}")
    mp = max(16, pow2(m))
    mr = min(mp, c.u2_mr) if c.u2_mr else mp
    mt = min(c.u2_mt, mr)
    if mp // min(c.u2_mt, mp) > U2_TILES:
        raise ValueError(f"cfg.u2_mt = {c.u2_mt} makes {mp // min(c.u2_mt, mp)} row tiles of {m} rows; "
                         f"the union2 kernels hold at most {U2_TILES}")
    return mt, mr // mt, mp // min(c.u2_mt, mp)


def _prepare_union2(m: int, k: int, n: int, k_out: int, c: DecodeConfig, gated: bool, has_bu: bool,
                    has_bd: bool, has_stats: bool, clean: bool, pdl: bool, act: str) -> Prepared:
    """``prepare`` for the union2 form (the gate GEMM is the launcher's cuBLAS call): the list
    launch over N / u2_bl blocks, the up launch over row groups of u2_mr rows x N / u2_c chunks
    (programs past the union's size exit), the down launch over K_out / u2_bo tiles x u2_s
    splits, and the finish unless u2_s is 1 (then the down launch writes y and reads the
    counters)."""
    mt, nt_up, nt_down = _union2_tiles(m, c)
    bl = c.u2_bl
    nb = -(-n // bl)
    nbp = max(16, pow2(nb))
    mp = max(16, pow2(m))
    bo = min(c.u2_bo, max(16, pow2(k_out)))
    direct = c.u2_s == 1
    dense_up = bool(c.u2_dense_up) and gated
    up_dot = gated and not dense_up
    bk = min(c.u2_bk, max(16, pow2(k)))
    sk = min(c.u2_sk, -(-k // bk)) if up_dot else 1          # K splits (only where the up launch dots)
    ks = -(-k // (sk * bk)) * bk                              # K per split, a multiple of BK
    nr, nc = mp // (mt * nt_up), -(-n // c.u2_c)
    # int32: per-block union slots [NB * BL], counts per block [NB], the compact union [N], tok
    # [M + 1]; fp32 words: the compact h [M, N] in x's dtype (2 bytes: half a word each), the K
    # splits' words (U2Split: the fp32 partials [nr, nc, SK, NT * MT, C], then a ticket per up chunk
    # and row group as int32, NB * BL of them zeroed by the list launch: nr = M_P / u2_mr <= MAX_M /
    # 16 = 16 <= C, so nr * nc <= N <= NB * BL; none without splits), total
    split = U2Split(nb * bl, nr * nc * sk * mt * nt_up * c.u2_c) if sk > 1 else None
    int_sizes = (nb * bl, nb, n, m + 1)
    float_sizes = ((m * n + 1) // 2, 0 if split is None else split.partials + split.tickets, 1)
    launch1 = (decode_union2_list_kernel, (nb,), (m, n), dict(BL=bl, RT=min(mp, 32), TK=split is not None,
                                                              PDL=pdl), 4, None)
    launch2 = (decode_union2_up_kernel, (nr, nc, sk), (m, k, n, nb, ks), dict(
        GATED=gated, HAS_BU=has_bu, DENSE_UP=dense_up, UP_DOT=up_dot, BL=bl, NBP=nbp, C=c.u2_c,
        BK=bk, MT=mt, NT=nt_up, SK=sk, PDL=pdl, ACT=ACTS.index(act)), c.u2_warps, c.u2_stages)
    launch3 = (decode_union2_down_kernel, (-(-k_out // bo), c.u2_s), (m, n, k_out, nb), dict(
        DIRECT=direct, HAS_BD=has_bd, HAS_ST=has_stats, NBP=nbp, BO=bo, CD=c.u2_cd, MT=mp // nt_down, NT=nt_down,
        CB=pow2(m), PDL=pdl), c.u2_dwarps, c.u2_dstages)
    launch4 = None if direct else _finish(m, k_out, has_bd, clean, has_stats, pdl)
    return Prepared(int_sizes, sum(int_sizes), float_sizes, sum(float_sizes), launch1, launch2, launch3, launch4,
                    uses_acc=not direct, split=split)


_prepared: dict[tuple, Prepared] = {}
MAX_PREPARED = 4096


def execute(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
            b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor], form: str,
            stats_buf: Optional[Tensor], c: DecodeConfig, graphed: bool = False, act: str = "relu") -> Decoded:
    """One decode call in a given form and config (decode_forward checks them). The shape-fixed
    arithmetic comes from ``prepare``, cached by shapes, form, flags and config (an eager call
    at decode sizes is host-bound: docs/inference.md "Host time"). ``graphed``: replay the
    call from the op's own CUDA graph where ``decode_graphs`` allows (then tok and hsum are
    the graph's buffers, valid until this layer's next call)."""
    m, k = x2.shape
    n, k_out = w_gate.shape[0], w_down.shape[0]
    dev = x2.device
    # W_down^T rows read through the transposed view (strided, no copy: a copy went stale on
    # updates that bump no version counter); the decode sizes gather few rows.
    wdt = w_down.t()
    state = decode_state.decode_state(w_down, m)
    registered = state is not None      # the accumulator persists: graphs may bake it
    if form == "list":
        state = None                    # no accumulator: the gather writes y
    key = (m, k, n, k_out, form, c, w_up is not None, b_gate is not None, b_up is not None,
           b_down is not None, stats_buf is not None, state is not None, pdl_ok(dev), act)
    p = _prepared.get(key)
    if p is None:
        if len(_prepared) >= MAX_PREPARED:
            _prepared.clear()
        p = _prepared[key] = prepare(m, k, n, k_out, form, c, *key[6:])
    if graphed and registered and decode_graphs.usable(x2):
        ptrs = tuple(0 if t is None else t.data_ptr()
                     for t in (w_gate, b_gate, w_up, b_up, wdt, b_down, stats_buf))
        gkey = key + (x2.dtype, dev, ptrs, None if state is None else state[0].data_ptr())
        return Decoded(*decode_graphs.run(gkey, x2, lambda xs: tuple(_launch_all(
            xs, w_gate, b_gate, w_up, b_up, wdt, state, b_down, form, stats_buf, p))))
    return _launch_all(x2, w_gate, b_gate, w_up, b_up, wdt, state, b_down, form, stats_buf, p)


def _launch_all(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                b_up: Optional[Tensor], wdt: Tensor, state: Optional[tuple], b_down: Optional[Tensor],
                form: str, stats_buf: Optional[Tensor], p: Prepared) -> Decoded:
    """The call's buffers and launches (``execute``; captured whole by ``decode_graphs``)."""
    m = x2.shape[0]
    k_out = wdt.shape[1]
    dev = x2.device
    y = torch.empty((m, k_out), dtype=x2.dtype, device=dev)
    # split_with_sizes, not Tensor.split (a Python wrapper around it)
    ln, lc, rc, tok = torch.empty(p.int_total, dtype=torch.int32, device=dev).split_with_sizes(p.int_sizes)
    fw = torch.empty(p.float_total, dtype=torch.float32, device=dev)
    lh, hs, hsum = fw.split_with_sizes(p.float_sizes)
    st = stats_buf if stats_buf is not None else fw
    bd = b_down if b_down is not None else y
    tk = cnt = hsa = None
    if state is not None:
        acc, tail = state
    elif form == "list":
        acc, tail = fw, None
    else:                               # unregistered weight: a fresh zeroed accumulator and tail
        ts = decode_state.tail_size(m)
        na = m * k_out if p.uses_acc else 0
        acc, tail = torch.zeros(na + ts, dtype=torch.float32, device=dev).split_with_sizes([na, ts])
        tail = tail.view(torch.int32)
    if tail is not None:
        tk, cnt, hsa = decode_state.tail_parts(tail)
    wu = w_up if w_up is not None else w_gate
    w = (x2, x2.stride(0), x2.stride(1), w_gate, w_gate.stride(0), w_gate.stride(1),
         b_gate if b_gate is not None else w_gate, wu, wu.stride(0), wu.stride(1),
         b_up if b_up is not None else w_gate)
    wd = (wdt, wdt.stride(0), wdt.stride(1))
    out = (acc, bd, y, k_out, 1, cnt, hsa, tok, hsum, st)     # what a finishing launch reads and writes
    if form == "list":
        _go(p.launch1, w + (ln, lh, lc, rc, hs) + wd + (acc,))
        _go(p.launch2, (ln, lh, lc) + wd + (bd, y, k_out, 1, rc, hs, tok, hsum, st))
    elif form == "pairs":
        _go(p.launch1, w + (ln, lh, lc, cnt, hsa) + wd + (acc,))
        _go(p.launch2, out)
    elif form == "union":
        lh = lh.view(x2.dtype)          # the list's h rows, in x's dtype
        _go(p.launch1, w + (ln, lh, lc, cnt, hsa))
        _go(p.launch2, (ln, lh, lc) + wd + out)
        if p.launch3 is not None:
            _go(p.launch3, out)
    elif form == "union2":
        _launch_union2(x2, w_gate, b_gate, w_up, b_up, wd, out, ln, lc, rc, lh, hs, cnt, hsa, p)
    else:
        _go(p.launch1, w + wd + (bd, acc, tk, cnt, hsa, y, k_out, 1, tok, hsum, st))
        if p.launch2 is not None:
            _go(p.launch2, out)
    return Decoded(y, tok, hsum)


def _go(spec: tuple, args: tuple) -> None:
    """One launch of a ``Prepared`` spec (kernel, grid, static ints, constexprs, warps, stages):
    the call's ``args``, then the spec's static ints."""
    kernel, grid, ints, consts, warps, stages = spec
    launch(kernel, grid, args + ints, consts, num_warps=warps, num_stages=stages, pdl=consts["PDL"])


def _launch_union2(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                   b_up: Optional[Tensor], wd: tuple, out: tuple, ln: Tensor, lc: Tensor, ci: Tensor, lh: Tensor,
                   ks: Tensor, cnt: Tensor, hsa: Tensor, p: Prepared) -> None:
    """The union2 form's calls: the gate as eager's own GEMM (cuBLAS: g [M, N] in x's dtype,
    so the active set is eager's), with u2_dense_up the up projection likewise, then the list,
    up and down launches and the finish (``_prepare_union2``). ``out``: what the down and
    finishing launches read and write; ``ks``: the K splits' fp32 scratch (empty without)."""
    g = F.linear(x2, w_gate, b_gate)
    u = F.linear(x2, w_up, b_up) if p.launch2[3]["DENSE_UP"] else g
    h = lh.view(x2.dtype)                # the compact h [M, N], in x's dtype
    wu = w_up if w_up is not None else w_gate
    if p.split is not None:              # K splits: partials, then tickets (zeroed by the list launch)
        part, tk = ks.split_with_sizes((p.split.partials, p.split.tickets))
        tk = tk.view(torch.int32)
    else:
        tk, part = ci, lh                # not read (TK and SK off)
    _go(p.launch1, (g, ln, lc, cnt, tk))
    _go(p.launch2, (x2, x2.stride(0), x2.stride(1), wu, wu.stride(0), wu.stride(1),
                    b_up if b_up is not None else wu, g, u, ln, lc, ci, h, hsa, part, tk))
    _go(p.launch3, (lc, ci, h) + wd + out)
    if p.launch4 is not None:
        _go(p.launch4, out)
