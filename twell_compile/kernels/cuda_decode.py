"""Host side of the decode path (kernels/twell_decode.py): few tokens, bf16/fp16.

For x [M, K] with M <= MAX_M: ``decode_fused_kernel``, one program per neuron block: gate over
all of K, relu, the active set, then up/down for the active neurons only (W_up rows contiguous
in nn.Linear's [N, K] layout, W_down^T rows read through W_down's transposed view, strided,
never copied), one neuron at a time with whole-row loads ("rows", M <= cfg.vec_m) or as
tl.dot tiles, added into an fp32 accumulator by atomics; the row block's last program (ticket)
writes y, the statistics and zeroes the accumulator again. One launch per FFN when the weight
is registered (its persistent accumulator, ``weight_cache.decode_state``) and the finish is
small (one row block, M x K_out <= cfg.finish_max); otherwise a zero-fill and/or a separate
finishing launch. No host sync, fixed launch shapes per M: CUDA-graph capturable. Exact at any
density: a neuron is skipped only where relu(g) is 0 and g finite in every row of its row block.

History (H200, K=2048, N=5632, M=1, d=0.005, CUDA graphs over 4 layers; dense 34.0 us;
docs/inference.md "Decode"): v1 Triton gate + down over N splits (42-60 us); v2 cuBLAS gate +
one kernel looping over K and K_out (46.8 us); v3 gate + up in one kernel appending to a list,
then a down kernel (22.2 us); v4 gate / up-down / finish in three launches (26.7 us); v5 (this)
one launch: 25.1 us with tile loops for up/down, 16.9 us with the rows form (2.01x;
``benchmarks/bench_ffn.py --decode``). An empty launch costs 1.4 us in a graph
(``benchmarks/tune_decode.py`` parts). The list form (twell_decode_list.py, ``form="list"``):
gate + up per active pair into per-token lists, then a gather launch; no atomics, no zeroed
state; M=16 26.8 us vs tiles 31.9 and dense 34.2 (1.28x), K=4096 M=16 1.46x (run 7). The pairs
form (same kernel, session 9): each active pair's h W_d^T[n] into the accumulator by atomics,
then the finishing launch: M=16 21.2 us (1.61x), K=4096 M=16 1.54x; fastest at 26 of the 56
grid points, the list form at none (it stays for deterministic mode: no atomics).
Session 11: launches with programmatic dependent launch on Hopper (``pdl_ok``; M=1 15.6 us,
2.17x; M=16 19.8 us, 1.73x), and the op's eager calls replay their own CUDA graph
(``execute(graphed=True)``, kernels/decode_graphs.py; host time, docs/inference.md).
Session 14: the pairs form up to 16 rows at 16 neurons per program, 2 pairs per trip and 2 warps
(M=16 18.5 us, 1.84x; M=2 15.2, 2.23x; results/h200/session14/).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from twell_compile.kernels import decode_graphs, weight_cache
from twell_compile.kernels.launch import launch
from twell_compile.kernels.cuda_infer import _INTERPRET, _pow2

MAX_M = 256           # row blocks of <= 32 rows; the policy uses a smaller threshold
MAX_MB = 32           # rows per program: M-tiles of 64 would select Hopper's wgmma, which gave
                      # wrong results at M_P=64 in the first H200 run (Triton 3.6)


class Config(NamedTuple):
    bn: int        # neurons per program
    bk: int        # K step of the gate loop
    bku: int       # K step of the up loop (tile path)
    bko: int       # K_out step of the down loop (tile path)
    vec_m: int     # M <= vec_m: up/down one active neuron at a time with whole-row loads
    finish_max: int  # finish in the kernel (last program) up to M x K_out elements, else a launch
    warps: int
    stages: int
    # the list form (twell_decode_list.py); H200 sweep (results/h200/decode_run7/probe2.json):
    # K=2048, M=16, d=0.005 25.9 us at (pb 4, le 32, bo 128), 26.5 at le 64, 30.0 at le 128;
    # K=4096 57.0 at le 32, 54.9 at le 64; bn 64 and 8 gather warps slower everywhere
    pb: int = 4        # active (row, neuron) pairs per gather step of the up projection
    kc: int = 2048     # K per step of that gather
    le: int = 64       # list entries per step of the down gather
    bo: int = 128      # K_out per down-gather program
    gwarps: int = 4    # warps of the down-gather kernel
    lbn: int = 32      # neurons per program of the list form's gate kernel
    udot: bool = False  # list form's up projection: tl.dot over the block's active neurons
                        # (all rows at once, steps of bku) instead of per-pair gathers
    lbk: int = 0       # K step of the list form's gate loop (0: bk)
    lstages: int = 0   # pipeline stages of the list form's first kernel (0: stages)
    koc: int = 2048    # pairs form: K_out per step of its W_d^T row loads and atomics
    gemv_bn: int = 0   # rows form at M=1: neurons per program of a whole-row GEMV gate (0: the
                       # tl.dot gate over bn); H200 K=2048: 12.5 us at 4 vs 14.9 (bn 32, tl.dot),
                       # 12.9 at 8, 13.8 at 16 (results/h200/session13/run4/, probe_stats.py at 2583eb0)
    pbn: int = 0       # the pairs form's own neurons per program (0: lbn), pairs per trip (0: pb)
    ppb: int = 0       # and warps (0: warps): session 14 tuned them apart from the list form,
    pwarps: int = 0    # which their values (16, 2, 2) made 20% slower (M=16: 30.8 us vs 25.7,
                       # bench_ffn.py --decode, results/h200/session14/run8 vs run14)


# By padded M, for K < WIDE_K: tuned on the H200 (benchmarks/tune_decode.py, results/h200/
# decode_run5/; the list and pairs fields: session 9 sweep, results/h200/session9/sweep.json,
# K=2048 N=5632 d=0.005: pairs at lbn 32, K step 128, 5 stages: M=4/8/16/32 17.6/19.7/20.9/27.8 us
# vs dense 33.9-34.8; lbn 64 23.5 at M=16, lbn 16 24.6; 8 pairs per step 21.9; udot 26.5).
# udot stays off (session 8: K=2048 M=16 24.7 us vs 26.8 for the list form, K=4096 slower).
# Session 14 (results/h200/session14/run4, sweep_pairs_trip.py final, interleaved medians,
# d=0.005): the pairs form at 16 neurons per program, 2 pairs per trip and 2 warps: M=16/8/4/2
# 18.5/16.7/15.4/14.5 us vs 19.6/18.0/16.2/15.9 at (lbn 32, pb 4, 4 warps); pb 4 at lbn 16
# spends 22.6 at M=16 (run 1), 1 warp 22.0 (run 4).
CONFIGS = {
    16: Config(32, 256, 256, 256, 4, 0, 4, 3, lbk=128, lstages=5, gemv_bn=4, pbn=16, ppb=2, pwarps=2),
    32: Config(64, 128, 256, 256, 0, 0, 4, 3, lbk=128, lstages=5),
    64: Config(64, 128, 256, 256, 0, 8192, 4, 3, lbk=128, lstages=5),
    128: Config(64, 128, 256, 256, 0, 8192, 4, 3, lbk=128, lstages=5),
    256: Config(64, 128, 256, 256, 0, 8192, 4, 3, lbk=128, lstages=5),
}
# K >= WIDE_K (tuned at K=4096, N=11008, same sweep): 64 neurons per list/pairs program up to 16
# rows (172 programs; M=16 51.9 us vs 55.8 at lbn 32, dense 87.0), and at 32 rows lbn 32 with
# K_out steps of 1024 (68.8 us vs 75.6 with whole 4096-wide rows in two steps of 2048).
WIDE_K = 3072
WIDE_CONFIGS = {      # (the GEMV gate: not measured at K >= WIDE_K; a [4, 4096] row block
                      # holds 128 fp32 registers per thread at 4 warps)
    16: CONFIGS[16]._replace(lbn=64, lbk=256, lstages=3, gemv_bn=0, pbn=0, ppb=0, pwarps=0),  # (session 14's
                      # lbn 16 / pb 2 / 2 warps: not measured at K >= WIDE_K)
    **{mp: c._replace(lbn=32, lbk=256, lstages=3, koc=1024) for mp, c in CONFIGS.items() if mp > 16},
}
FINISH_BLOCK = 1024   # accumulator elements per step of a finishing program
STAT_BLOCKS = 256     # neuron blocks per step of the list form's statistics sum


def m_pad(m: int) -> int:
    return max(16, _pow2(m))


def config_for(m: int, k: int) -> Config:
    """The launch config for M rows of width K (CONFIGS, or WIDE_CONFIGS for K >= WIDE_K)."""
    mp = m_pad(min(m, MAX_M))
    return (WIDE_CONFIGS if k >= WIDE_K else CONFIGS)[mp]


def rows_gemv(m: int, c: Config) -> bool:
    """Whether the rows form gates M rows by the whole-row GEMV (M=1 where c.gemv_bn is set)."""
    return m == 1 and c.gemv_bn > 0


def rows_bn(m: int, c: Config) -> int:
    """Neurons per program of the rows form for M rows: c.gemv_bn with the GEMV gate, else c.bn."""
    return c.gemv_bn if rows_gemv(m, c) else c.bn


def pairs_bn(c: Config) -> int:
    """Neurons per program of the pairs form (c.pbn, else the list form's c.lbn)."""
    return c.pbn or c.lbn


def pairs_pb(c: Config) -> int:
    """Active pairs per trip of the pairs form (c.ppb, else the list form's c.pb)."""
    return c.ppb or c.pb


def m_pad_rows(m: int) -> int:
    """Rows of the per-neuron (rows) up/down path for M rows."""
    return _pow2(m)


# Programmatic dependent launch (Hopper+): each decode launch may begin while the previous kernel
# in the stream finishes (the kernels wait on griddepcontrol before touching memory), hiding
# launch latency between the two launches of a call and between calls. TWELL_PDL=0 turns it off.
PDL = os.environ.get("TWELL_PDL", "1") != "0"
_pdl_devices: dict[int, bool] = {}


def pdl_ok(device: torch.device) -> bool:
    """Whether decode launches on ``device`` use programmatic dependent launch: PDL on, compute
    capability >= 9.0, Triton with griddepcontrol (triton.language.extra.cuda.gdc_wait), not
    the interpreter. Cached per device."""
    if not PDL or _INTERPRET:
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


class Decoded(NamedTuple):
    y: Tensor        # [M, K_out]
    tok: Tensor      # [M + 1] int32: non-zeros of relu(g) per token, then their total
    hsum: Tensor     # [1] fp32: sum |h|


FORMS = ("rows", "tiles", "list", "pairs")


def decode_forward(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
                   b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor],
                   cfg: Optional[Config] = None, stats_buf: Optional[Tensor] = None,
                   form: Optional[str] = None, graphed: bool = False) -> Decoded:
    """The FFN for x2 [M, K], M <= MAX_M. ``stats_buf``: a layer's float64 [4] statistics buffer
    (stats.py) that the kernels fill in place (sum and max of non-zeros per token, sum |h|, 0).
    ``form``: how up/down run: "rows" (one active neuron at a time, only for M <= cfg.vec_m),
    "tiles" (tl.dot tiles, atomics), "list" (per-token lists, a gather launch; no atomics) or
    "pairs" (per active pair, atomics); None: rows where M <= cfg.vec_m, else tiles (the
    policy decides by density, cuda_policy.decode_form). ``cfg``: default config_for(M, K).
    ``graphed``: eager calls replay the op's own CUDA graph (``decode_graphs``; the op passes
    it); tok and hsum are then the graph's buffers, overwritten by the layer's next call."""
    m, k = x2.shape
    if m > MAX_M:
        raise ValueError(f"decode path takes M <= {MAX_M} rows, got x with {m}")
    if form not in (None,) + FORMS:
        raise ValueError(f"form must be one of {FORMS} or None, got {form!r}")
    if m == 0:
        dev = x2.device
        return Decoded(torch.empty((0, w_down.shape[0]), dtype=x2.dtype, device=dev),
                       torch.zeros(1, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.float32, device=dev))
    c = cfg or config_for(m, k)
    if form is None:
        form = "rows" if m <= c.vec_m else "tiles"
    elif form == "rows" and m > c.vec_m:
        raise ValueError(f"form='rows' takes M <= cfg.vec_m = {c.vec_m} rows, got {m}")
    return execute(x2, w_gate, b_gate, w_up, b_up, w_down, b_down, form, stats_buf, c, graphed)


class Prepared(NamedTuple):
    """The host arithmetic of a decode call, fixed by its shapes, form and flags (``prepare``):
    per-call buffer sizes, and per launch the kernel, grid, static int arguments, constexprs,
    warps and stages. Holds no tensors, so ``execute`` keeps these in a plain dict."""
    int_sizes: tuple         # int32 scratch: list neurons, list counts, non-zeros per block row, tok
    int_total: int
    float_sizes: tuple       # fp32 scratch: list h, sum |h| per block, total
    float_total: int
    launch1: tuple           # (kernel, grid, static ints, constexprs, warps, stages)
    launch2: Optional[tuple]  # the same for the finishing / gather launch (None: in-kernel finish)


def prepare(m: int, k: int, n: int, k_out: int, form: str, c: Config, gated: bool, has_bg: bool,
            has_bu: bool, has_bd: bool, has_stats: bool, clean: bool, pdl: bool = False) -> Prepared:
    """``clean``: the accumulator is a registered weight's persistent one (zero between calls).
    ``pdl``: launch with programmatic dependent launch (``pdl_ok``)."""
    from twell_compile.kernels.twell_decode import decode_finish_kernel, decode_fused_kernel
    from twell_compile.kernels.twell_decode_list import decode_gather_kernel, decode_pairs_kernel

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
    finish = (decode_finish_kernel, (-(-(m * k_out) // FINISH_BLOCK) + 1,), (m, k_out), dict(
        HAS_BD=has_bd, CLEAN=clean, HAS_ST=has_stats, BLOCK=FINISH_BLOCK, CB=_pow2(m), PDL=pdl), 4, None)
    p2 = lambda v: min(v, max(16, _pow2(k)))  # noqa: E731  (a K step: at most K padded)
    if lists:
        launch1 = (decode_pairs_kernel, (nb, nrb), (m, k, n, nb, k_out), dict(
            GATED=gated, HAS_BG=has_bg, HAS_BU=has_bu, MB=mb, BN=bn, BK=p2(c.lbk or c.bk),
            PB=pairs_pb(c) if pairs else c.pb,
            KC=p2(c.kc), UDOT=c.udot, BKU=p2(c.bku), ADOWN=form == "pairs",
            KOC=min(c.koc, max(16, _pow2(k_out))), PDL=pdl),
            (c.pwarps or c.warps) if pairs else c.warps, c.lstages or c.stages)
        if form == "pairs":
            launch2 = finish
        else:
            bo = min(c.bo, max(16, _pow2(k_out)))
            no = -(-k_out // bo)
            launch2 = (decode_gather_kernel, (m * no + 1,), (m, n, k_out, nb, no, nrb), dict(
                HAS_BD=has_bd, HAS_ST=has_stats, MB=mb, BN=c.lbn, NBP=max(16, _pow2(nb)), LE=c.le,
                BO=bo, RB=STAT_BLOCKS, PDL=pdl), c.gwarps, None)
    else:
        fin = nrb == 1 and m * k_out <= c.finish_max
        ms = m_pad_rows(m) if form == "rows" else 0     # rows of the per-neuron up/down path
        launch1 = (decode_fused_kernel, (nb, nrb), (m, k, n, k_out), dict(
            GATED=gated, HAS_BG=has_bg, HAS_BU=has_bu, HAS_BD=has_bd, FINISH=fin, CLEAN=clean,
            HAS_ST=has_stats, MB=mb, BN=bn, BK=p2(c.bk), BKU=p2(c.bku),
            BKO=min(c.bko, max(16, _pow2(k_out))), MS=ms, KP=_pow2(k) if ms else 1,
            KOP=_pow2(k_out) if ms else 1, FB=FINISH_BLOCK, CB=_pow2(m), GEMV=gemv, PDL=pdl), c.warps, c.stages)
        launch2 = None if fin else finish
    return Prepared(int_sizes, sum(int_sizes), float_sizes, sum(float_sizes), launch1, launch2)


_prepared: dict[tuple, Prepared] = {}
MAX_PREPARED = 4096


def execute(x2: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Optional[Tensor],
            b_up: Optional[Tensor], w_down: Tensor, b_down: Optional[Tensor], form: str,
            stats_buf: Optional[Tensor], c: Config, graphed: bool = False) -> Decoded:
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
    state = weight_cache.decode_state(w_down, m)
    registered = state is not None      # the accumulator persists: graphs may bake it
    if form == "list":
        state = None                    # no accumulator: the gather writes y
    key = (m, k, n, k_out, form, c, w_up is not None, b_gate is not None, b_up is not None,
           b_down is not None, stats_buf is not None, state is not None, pdl_ok(dev))
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
        ts = weight_cache.tail_size(m)
        acc, tail = torch.zeros(m * k_out + ts, dtype=torch.float32, device=dev).split_with_sizes([m * k_out, ts])
        tail = tail.view(torch.int32)
    if tail is not None:
        tk, cnt, hsa = weight_cache.tail_parts(tail)
    wu = w_up if w_up is not None else w_gate
    w = (x2, x2.stride(0), x2.stride(1), w_gate, w_gate.stride(0), w_gate.stride(1),
         b_gate if b_gate is not None else w_gate, wu, wu.stride(0), wu.stride(1),
         b_up if b_up is not None else w_gate)
    wd = (wdt, wdt.stride(0), wdt.stride(1))
    k1, g1, s1, c1, w1, st1 = p.launch1
    if form == "list":
        launch(k1, g1, w + (ln, lh, lc, rc, hs) + wd + (acc,) + s1, c1, num_warps=w1, num_stages=st1,
               pdl=c1["PDL"])
    elif form == "pairs":
        launch(k1, g1, w + (ln, lh, lc, cnt, hsa) + wd + (acc,) + s1, c1, num_warps=w1, num_stages=st1,
               pdl=c1["PDL"])
    else:
        launch(k1, g1, w + wd + (bd, acc, tk, cnt, hsa, y, k_out, 1, tok, hsum, st) + s1, c1,
               num_warps=w1, num_stages=st1, pdl=c1["PDL"])
    if p.launch2 is not None:
        k2, g2, s2, c2, w2, _ = p.launch2
        if form == "list":
            a2 = (ln, lh, lc) + wd + (bd, y, k_out, 1, rc, hs, tok, hsum, st) + s2
        else:
            a2 = (acc, bd, y, k_out, 1, cnt, hsa, tok, hsum, st) + s2
        launch(k2, g2, a2, c2, num_warps=w2, pdl=c2["PDL"])
    return Decoded(y, tok, hsum)
