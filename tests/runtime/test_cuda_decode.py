"""Decode path (runtime/cuda_decode.py, kernels/twell_decode*.py): the kernels under
TRITON_INTERPRET=1 on the CPU (tiny shapes, fp16: the interpreter's bf16 tl.dot is broken), the
decode state and the decode rule (runtime/select.py) on the CPU, and GPU tests
(@pytest.mark.gpu): error grid with the 2x rule vs an fp32 reference, NaN/Inf, poisoned
outputs, CUDA-graph capture and replay, in-place weight updates, the op's plan by M,
torch.compile with reduce-overhead. Cost-model constants other than the shipped ones come in
through ``arch.patched``."""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import twell_compile.ops  # noqa: F401  (registers torch.ops.twell when this file runs alone)
from tests.helpers import ffn_args as _args, ffn_with_biases, last_paths, poison as _poison, rel as _rel, run_interpreted
from twell_compile.testing import GatedMLP
from twell_compile.runtime import arch, decode_state as ds, select

P = arch.H200

# ----------------------------------------------------------------------------- interpreter
SCRIPT = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from twell_compile.runtime.cuda_decode import decode_forward
    from twell_compile.runtime.arch import DecodeConfig as Config
    from twell_compile.reference import activate, ffn_dense
    torch.manual_seed({seed})
    m, k, n, ko, gated, bias, density, bad, cfg, form = {case}
    act = {act!r}
    down_t = {down_t}
    dt = torch.float16
    if form in ("union", "union2"):   # scratch and outputs poisoned: what a kernel leaves unwritten shows
        _empty = torch.empty
        def _poisoned(*a, **kw):
            t = _empty(*a, **kw)
            return t.fill_(float("nan") if t.is_floating_point() else -(1 << 30) if t.dtype == torch.int32 else 0)
        torch.empty = _poisoned
    x = torch.randn(m, k)
    x[:, 0] = 1.0
    wg = torch.randn(n, k) / k ** .5
    # column 0 of x is 1: wg[:, 0] sets P(g > 0) (anchors.md); density 0: nothing fires
    shift = -1e4 if density == 0 else float(-torch.special.ndtri(torch.tensor(1.0 - density))) if density < 1 else 8.0
    wg[:, 0] = shift
    if 0 < density < 1 and m > 2:
        x[m - 1, 0] = 50.0                       # a row with no active neuron at all
    x, wg = x.to(dt), wg.to(dt)
    bg = (torch.randn(n) * 0.1).to(dt) if bias else None
    wu = (torch.randn(n, k) / k ** .5).to(dt) if gated else None
    bu = torch.randn(n).to(dt) if bias and gated else None
    wd = (torch.randn(ko, n) / (n * max(density, 0.01)) ** .5).to(dt)
    if down_t:               # W_down stored transposed (prepare(down_layout="transposed")): wd.t() contiguous
        wd = wd.t().contiguous().t()
    bd = torch.randn(ko).to(dt) if bias else None
    if bad:
        x[1, 3] = float("nan"); x[0, 5] = float("inf")
    args = (x, wg, bg, wu, bu, wd, bd)
    from twell_compile.runtime import decode_state
    if m % 2:    # odd M: through the registered W_down's persistent state
        assert decode_state.register(wd)
    if isinstance(cfg, dict):    # fields replaced in the record's config for this M
        from twell_compile.runtime.cuda_decode import config_for
        cfg = config_for(m, k, x.device)._replace(**cfg)
    elif cfg is not None:
        cfg = Config(*cfg)
    st = torch.full((4,), float("nan"), dtype=torch.float64)
    y, tok, hsum = decode_forward(*args, cfg=cfg, stats_buf=st, form=form, act=act)
    if m % 2:    # the persistent state is zero again, and a second call agrees
        assert not decode_state.decode_state(wd, m)[0].any() and not decode_state.decode_state(wd, m)[1].any()
        y2 = decode_forward(*args, cfg=cfg, form=form, act=act).y
        assert torch.allclose(y2.float(), y.float(), rtol=1e-2, atol=1e-2, equal_nan=True), "second call"
        if form == "list":     # no atomics: the same bits
            assert torch.equal(y2, y) or bad, "list form not repeatable"
    eager = ffn_dense(*args, act)
    assert torch.equal(torch.isnan(y), torch.isnan(eager)), "nan pattern"
    if form in ("union", "union2"):   # the statistics the pairs form gives (g's rounding at 0 may differ)
        st2 = torch.full((4,), float("nan"), dtype=torch.float64)
        _, tok2, hsum2 = decode_forward(*args, stats_buf=st2, form="pairs", act=act)
        assert (tok - tok2).abs().sum() <= 2 and abs(int(tok[m]) - int(tok2[m])) <= 2, (tok, tok2)
        assert torch.allclose(hsum, hsum2, rtol=1e-3, atol=1e-3, equal_nan=True), (hsum, hsum2)
        assert torch.allclose(st, st2, rtol=1e-3, atol=2, equal_nan=True), (st, st2)
    hg = torch.relu(F.linear(x, wg, bg))
    cnt = (hg != 0).sum(1).int()
    assert (tok[:m] - cnt).abs().sum() <= 2, (tok, cnt)
    assert int(tok[m]) == int(tok[:m].sum()), "total"
    assert st[0] == tok[m] and st[1] == tok[:m].max() and st[3] == 0, st
    assert abs(float(st[2]) - float(hsum)) <= 1e-3 * abs(float(hsum)) or (bad and not torch.isfinite(st[2]))
    fin = torch.isfinite(x).all(1)
    ref = ffn_dense(*(None if a is None else a[fin].double() if i == 0 else a.double()
                      for i, a in enumerate(args)), act)
    err = ((y[fin].double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    derr = ((eager[fin].double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err <= 2 * derr + 1e-6, (err, derr)
    if density == 0 and not bias:
        assert (y == 0).all()
    if not bad:
        h = activate(hg.float(), F.linear(x, wu, bu).float() if gated else None, act)
        assert abs(float(hsum) - float(h.double().abs().sum())) <= 1e-2 * float(h.double().abs().sum()) + 1e-3
    print("ok", err, derr)
""")

CASES = [
    # m, k, n, k_out, gated, bias, density, nan/inf rows, config (None: default): arch.DecodeConfig
    # (bn, bk, bku, bko, vec_m, finish_max, warps, stages[, pb, kc, le, bo, gwarps, lbn, udot, lbk, lstages,
    # koc, gemv_bn, pbn, ppb, pwarps]), form (None:
    # rows/tiles by vec_m); odd M: registered W_down (persistent state)
    (1, 33, 130, 17, True, True, 0.3, False, None, None),      # M = 1, odd K, N, K_out (per-neuron path, GEMV gate)
    (1, 40, 70, 40, True, False, 1.0, False, (32, 16, 16, 16, 4, 0, 4, 1) + (4, 2048, 64, 128, 4, 32, False, 0, 0,
                                                                          2048, 8), None),  # GEMV gate, 8 neurons, density 1
    (2, 100, 130, 17, True, True, 0.3, True, (16, 16, 32, 16, 0, 0, 4, 1), None),  # tiles, finishing launch, NaN/Inf
    (3, 40, 100, 24, False, False, 0.3, False, None, None),    # non-gated, a row with no active neuron
    (16, 40, 300, 40, True, True, 0.05, True, None, None),     # NaN and Inf rows
    (3, 40, 70, 40, True, False, 1.0, False, None, None),      # density 1
    (3, 40, 70, 40, True, True, 0.0, False, None, None),       # density 0, biases
    (17, 72, 257, 65, False, True, 0.3, False, (32, 32, 16, 32, 0, 64, 4, 1), None),   # M x K_out > finish_max
    (5, 24, 61, 9, True, True, 0.3, True, (16, 16, 16, 16, 8, 1 << 20, 4, 1), None),  # per-neuron M=5 (8 rows), NaN/Inf
    (40, 24, 61, 33, True, True, 0.3, True, (16, 16, 16, 16, 0, 1 << 20, 4, 1), None),  # two row blocks
    (33, 24, 61, 33, True, True, 0.3, False, None, None),      # two row blocks, registered
    (4, 24, 61, 33, False, True, 0.3, True, (16, 16, 16, 16, 4, 1 << 20, 4, 1), None),  # per-neuron, non-gated, NaN/Inf
    # the list form (per-token lists + a gather launch)
    (16, 40, 300, 40, True, True, 0.05, True, None, "list"),     # NaN and Inf rows
    (3, 40, 100, 24, False, False, 0.3, False, None, "list"),   # non-gated, a row with nothing active
    (3, 40, 70, 40, True, False, 1.0, False, (16, 16, 16, 16, 0, 0, 4, 1, 2, 16, 8, 16, 4), "list"),  # density 1, K chunks
    (3, 40, 70, 40, True, True, 0.0, False, None, "list"),      # density 0, biases
    (40, 24, 61, 33, True, True, 0.3, True, (16, 16, 16, 16, 0, 0, 4, 1, 4, 32, 16, 16, 4), "list"),  # two row blocks
    (17, 72, 257, 65, False, True, 0.3, False, None, "list"),   # odd shapes, several K_out programs
    # the list form with its up projection as tl.dot over the block's active neurons (udot)
    (16, 40, 300, 40, True, True, 0.05, True, (32, 16, 16, 16, 0, 0, 4, 1, 4, 16, 16, 16, 4, 32, True), "list"),
    (3, 40, 70, 40, True, True, 1.0, False, (16, 16, 16, 16, 0, 0, 4, 1, 2, 16, 8, 16, 4, 16, True), "list"),
    (5, 72, 257, 65, True, False, 0.3, True, (32, 32, 32, 16, 0, 0, 4, 1, 4, 32, 16, 16, 4, 32, True), "list"),
    (3, 40, 100, 24, False, False, 0.3, False, (32, 16, 16, 16, 0, 0, 4, 1, 4, 16, 16, 16, 4, 32, True), "list"),
    # the pairs form (per active pair: up, then h W_d^T[n] into the accumulator by atomics)
    (16, 40, 300, 40, True, True, 0.05, True, None, "pairs"),    # NaN and Inf rows
    (3, 40, 100, 24, False, False, 0.3, False, None, "pairs"),  # non-gated, a row with nothing active
    (3, 40, 70, 40, True, False, 1.0, False, (16, 16, 16, 16, 0, 0, 4, 1, 2, 16, 8, 16, 4, 16, False, 0, 0, 16), "pairs"),  # density 1, K and K_out chunks
    (5, 40, 70, 40, True, True, 0.0, False, None, "pairs"),     # density 0, biases, registered
    (40, 24, 61, 33, True, True, 0.3, True, (16, 16, 16, 16, 0, 0, 4, 1, 4, 32, 16, 16, 4, 16, False, 0, 0, 16), "pairs"),  # two row blocks, 3 K_out chunks
    (17, 72, 257, 65, False, True, 0.3, False, None, "pairs"),  # odd shapes, registered
    (5, 72, 257, 65, True, False, 0.3, True, (32, 32, 32, 16, 0, 0, 4, 1, 4, 32, 16, 16, 4, 32, True, 0, 0, 32), "pairs"),  # udot, NaN/Inf
]

# the union form (each neuron block's union over all rows listed, then the down launch over the
# union); config: union_* fields replaced in the record's config (dict), or None; W_down stored
# as nn.Linear keeps it or transposed
UNION_CASES = [
    # m, k, n, k_out, gated, bias, density, nan/inf rows, config, form, W_down transposed
    (16, 64, 200, 40, True, True, 0.005, False, dict(union_bn=16, union_c=16, union_bo=16), "union", False),
    (17, 72, 130, 33, True, False, 0.3, True, dict(union_c=16, union_bo=16, union_s=3), "union", True),
    (33, 96, 150, 24, False, True, 0.3, False, dict(union_s=1, union_c=32, union_bo=16), "union", True),   # y direct
    (64, 64, 96, 40, True, True, 1.0, False, dict(union_bn=16, union_c=32, union_mb=16), "union", False),  # 4 row tiles
    (16, 80, 120, 40, True, True, 0.0, False, None, "union", False),           # density 0, biases, the record's config
    (33, 64, 200, 17, True, True, 0.005, True, dict(union_s=1, union_bn=16, union_c=16), "union", False),
    (64, 96, 177, 65, False, False, 0.005, False, dict(union_s=2, union_mb=32), "union", True),  # odd N, 2 row tiles
    (17, 64, 100, 40, True, False, 1.0, True, dict(union_s=1), "union", False),   # density 1, y direct, NaN/Inf
    (64, 64, 130, 24, True, True, 0.3, True, dict(union_bn=16, union_c=16, union_bo=16), "union", True),
    (16, 64, 96, 40, False, False, 0.0, False, dict(union_s=1), "union", True),   # density 0: y is 0
]

# the union2 form (the gate by F.linear, the union listed per block, up over chunks of the
# compacted union, down over K_out tiles x splits; all rows per program in row tiles); config:
# u2_* fields replaced in the record's config (dict), or None; W_down as nn.Linear keeps it or
# transposed
UNION2_CASES = [
    # m, k, n, k_out, gated, bias, density, nan/inf rows, config, form, W_down transposed
    (16, 64, 200, 40, True, True, 0.005, False, dict(u2_c=16, u2_bo=16), "union2", False),
    (17, 72, 130, 33, True, False, 0.3, True, dict(u2_c=16, u2_bo=16, u2_s=3), "union2", True),   # 2 row tiles of 16
    (33, 96, 150, 24, False, True, 0.3, False, dict(u2_s=1, u2_cd=32, u2_bo=16), "union2", True),   # y direct
    (64, 64, 96, 40, True, True, 1.0, False, dict(u2_bl=16, u2_cd=16, u2_mt=16), "union2", False),  # 4 row tiles
    (16, 80, 120, 40, True, True, 0.0, False, None, "union2", False),          # density 0, biases, the record's config
    (33, 64, 200, 17, True, True, 0.005, True, dict(u2_s=1, u2_bl=16, u2_c=16), "union2", False),  # NaN/Inf, direct
    (64, 96, 177, 65, False, False, 0.005, False, dict(u2_s=2, u2_mr=32), "union2", True),   # odd N, 2 row groups
    (17, 64, 100, 40, True, False, 1.0, True, dict(u2_s=1), "union2", False),    # density 1, y direct, NaN/Inf
    (64, 64, 130, 24, True, True, 0.3, True, dict(u2_c=16, u2_bo=16, u2_cd=16, u2_mr=16, u2_mt=16), "union2",
     True),                                                                    # 4 row groups of 16
    (16, 64, 96, 40, False, False, 0.0, False, dict(u2_s=1), "union2", True),  # density 0: y is 0
    (64, 96, 177, 65, True, True, 0.005, True, dict(u2_mr=32, u2_s=2, u2_dense_up=True), "union2", True),  # dense up
    (128, 48, 100, 40, True, True, 0.3, False, dict(u2_mt=16, u2_c=16, u2_bo=16, u2_cd=16), "union2", False),  # 8 tiles
    # K split in the up launch: partials summed by each chunk's last program (tickets zeroed by the list launch)
    (64, 96, 177, 65, True, True, 0.3, True, dict(u2_sk=3, u2_bk=16, u2_mr=32, u2_c=16), "union2", True),  # 2 groups
    (17, 72, 130, 33, True, False, 0.005, False, dict(u2_sk=4, u2_bk=32, u2_c=16, u2_s=1), "union2", False),  # K=72
    (33, 64, 150, 24, True, True, 1.0, True, dict(u2_sk=8, u2_bk=16, u2_c=16, u2_mt=16), "union2", True),  # 8 x 16
    (16, 64, 96, 40, False, True, 0.3, False, dict(u2_sk=4, u2_bk=16), "union2", True),   # non-gated: no split
]


def test_rows_form_gemv_gate_only_at_one_row():
    from twell_compile.runtime import cuda_decode

    c = P.decode_config(1, 2048)
    assert c.gemv_bn and arch.rows_bn(1, c) == c.gemv_bn and arch.rows_bn(2, c) == c.bn
    for m, k, gemv, bn in ((1, 2048, True, c.gemv_bn), (2, 2048, False, c.bn), (1, 4096, False, c.bn)):
        p = cuda_decode.prepare(m, k, 5632, 2048, "rows", P.decode_config(m, k), True, False, False, False,
                                True, True)
        kern, grid, _, consts, _, _ = p.launch1
        assert consts["GEMV"] is gemv and consts["BN"] == bn and grid[0] == -(-5632 // bn), (m, k, consts)
        assert p.int_sizes[2] == 0 and p.float_sizes[1] == 0      # statistics go to the counters
    p = cuda_decode.prepare(1, 2048, 5632, 2048, "tiles", c, True, False, False, False, True, True)
    assert p.launch1[3]["GEMV"] is False and p.launch1[3]["BN"] == c.bn
    p = cuda_decode.prepare(3, 2048, 5632, 2048, "list", c, True, False, False, False, True, False)
    assert p.int_sizes[2] == -(-5632 // c.lbn) * 16      # the list form writes them per (block, row)


def test_list_and_pairs_launch_take_their_own_warps_and_blocks():
    from twell_compile.runtime import cuda_decode

    c = P.decode_config(16, 2048)
    assert c.pbn and c.ppb and c.pwarps and (c.pbn, c.ppb, c.pwarps) != (c.lbn, c.pb, c.warps)
    want = {"pairs": (c.pwarps, c.pbn, c.ppb), "list": (c.warps, c.lbn, c.pb)}
    for form, (warps_w, bn_w, pb_w) in want.items():
        kern, grid, _, consts, warps, stages = cuda_decode.prepare(16, 2048, 5632, 2048, form, c, True, False, False,
                                                                   False, True, True).launch1
        assert (warps, stages, consts["BN"], consts["PB"]) == (warps_w, c.lstages, bn_w, pb_w), form
        assert grid == (-(-5632 // bn_w), 1)
    warps = cuda_decode.prepare(16, 2048, 5632, 2048, "tiles", c, True, False, False, False, True, True).launch1[4]
    assert warps == c.warps
    wide = P.decode_config(16, 4096)           # K >= wide_k: the pairs form takes the list form's fields
    kern, grid, _, consts, warps, _ = cuda_decode.prepare(16, 4096, 11008, 4096, "pairs", wide, True, False, False,
                                                          False, True, True).launch1
    assert (warps, consts["BN"], consts["PB"]) == (wide.warps, wide.lbn, wide.pb)


def test_union_form_launch_shapes():
    """The union form at the benchmark shape (K=2048, N=5632, K_out=2048): 176 list programs of
    32 neurons over all M rows at once, the down launch over 64 K_out tiles x union_s splits x row
    tiles, then the finish; one split: the down launch writes y (no finish, no accumulator)."""
    from twell_compile.kernels.twell_decode import decode_finish_kernel
    from twell_compile.runtime import cuda_decode
    for m in (16, 17, 64, 128, 256):
        c = P.decode_config(m, 2048)
        mp = max(16, arch.next_pow2(m))
        p = cuda_decode.prepare(m, 2048, 5632, 2048, "union", c, True, False, False, False, True, True)
        _, g1, s1, c1, w1, st1 = p.launch1
        assert g1 == (-(-5632 // c.union_bn),) and g1[0] >= 150 and s1 == (m, 2048, 5632)
        assert (c1["BN"], c1["MP"], w1, st1) == (c.union_bn, mp, c.union_warps, c.union_stages)
        _, g2, s2, c2, w2, st2 = p.launch2
        assert g2 == (2048 // c.union_bo, c.union_s, 1) and g2[0] * g2[1] >= 256, (m, g2)   # ~2 per SM of 132
        assert (c2["BO"], c2["C"], c2["MT"], c2["DIRECT"], w2, st2) == (
            c.union_bo, c.union_c, mp, False, c.union_dwarps, c.union_dstages)
        assert p.launch3[0] is decode_finish_kernel and p.uses_acc
        assert p.int_sizes == (g1[0] * c.union_bn, g1[0], 0, m + 1)
        assert p.float_sizes[0] * 2 == g1[0] * c.union_bn * mp         # h in x's dtype, 2 per fp32 word
        # one split: y written by the down launch
        d = cuda_decode.prepare(m, 2048, 5632, 2048, "union", c._replace(union_s=1), True, False, False, False,
                                True, True)
        assert d.launch3 is None and not d.uses_acc and d.launch2[3]["DIRECT"] and d.launch2[1][1] == 1
    p = cuda_decode.prepare(256, 2048, 5632, 2048, "union", P.decode_config(256, 2048)._replace(union_mb=64),
                            True, False, False, False, True, False)
    assert p.launch2[1][2] == 4 and p.launch2[3]["MT"] == 64               # 4 row tiles of 64
    assert not p.launch3[3]["CLEAN"]


@pytest.mark.parametrize("form,field,value", [
    ("union", "union_c", 24), ("union", "union_bo", 8), ("union", "union_bn", 0), ("union", "union_bk", 48),
    ("union", "union_mb", 8), ("union", "union_s", 0),
    ("union2", "u2_c", 24), ("union2", "u2_bo", 8), ("union2", "u2_bl", 0), ("union2", "u2_bk", 48),
    ("union2", "u2_cd", 8), ("union2", "u2_mt", 12), ("union2", "u2_mr", 8), ("union2", "u2_s", 0),
    ("union2", "u2_sk", 0)])
def test_union_forms_reject_bad_config_fields(form, field, value):
    from twell_compile.runtime.cuda_decode import decode_forward
    x = torch.zeros(16, 16, dtype=torch.float16)
    w = torch.zeros(32, 16, dtype=torch.float16)
    cfg = P.decode_config(16, 16)._replace(**{field: value})
    with pytest.raises(ValueError, match=f"cfg.{field}"):
        decode_forward(x, w, None, w, None, w.t().contiguous(), None, cfg=cfg, form=form)


def test_union2_form_launch_shapes():
    """The union2 form at the benchmark shape (K=2048, N=5632, K_out=2048): the list launch over
    N / u2_bl blocks, the up launch over N / u2_c chunks (all rows per program: one row group,
    M padded / u2_mt row tiles), the down launch over K_out / u2_bo tiles x u2_s splits with all
    row tiles, then the finish; one split: the down launch writes y (no finish, no accumulator)."""
    from twell_compile.kernels.twell_decode import decode_finish_kernel
    from twell_compile.kernels.twell_decode_union2 import (decode_union2_down_kernel, decode_union2_list_kernel,
                                                           decode_union2_up_kernel)
    from twell_compile.runtime import cuda_decode
    for m in (16, 17, 64, 128, 256):
        c = P.decode_config(m, 2048)
        mp = max(16, arch.next_pow2(m))
        mt = min(c.u2_mt, mp)
        assert mt <= arch.MAX_MB                                     # tl.dot's M side off wgmma
        p = cuda_decode.prepare(m, 2048, 5632, 2048, "union2", c, True, False, False, False, True, True)
        k1, g1, s1, c1, w1, _ = p.launch1
        nb = -(-5632 // c.u2_bl)
        assert k1 is decode_union2_list_kernel and g1 == (nb,) and s1 == (m, 5632) and c1["BL"] == c.u2_bl
        k2, g2, s2, c2, w2, st2 = p.launch2
        nr = mp // (mt * c2["NT"])
        sk = c.u2_sk
        ks = -(-2048 // (sk * c.u2_bk)) * c.u2_bk
        assert k2 is decode_union2_up_kernel and g2 == (nr, -(-5632 // c.u2_c), sk)
        assert s2 == (m, 2048, 5632, nb, ks) and (sk - 1) * ks < 2048 <= sk * ks       # every split holds some K
        assert (c2["C"], c2["MT"], c2["BK"], c2["SK"], w2, st2) == (c.u2_c, mt, c.u2_bk, sk, c.u2_warps, c.u2_stages)
        assert nr * c2["NT"] * mt == mp                                 # the row groups cover the padded rows
        assert c1["TK"] == (sk > 1) and (p.split is not None) == (sk > 1)
        if sk > 1:                                                      # a ticket per chunk and row group
            assert p.split.tickets == nb * c.u2_bl >= nr * g2[1]
            assert p.split.partials == nr * g2[1] * sk * c2["NT"] * mt * c.u2_c
        # in the call's fp32 scratch, after h: the partials and tickets (none without splits)
        assert p.float_sizes[1] == (0 if sk == 1 else p.split.partials + p.split.tickets)
        assert c2["UP_DOT"] and not c2["DENSE_UP"] and c2["NBP"] >= nb
        k3, g3, s3, c3, w3, st3 = p.launch3
        assert k3 is decode_union2_down_kernel and g3 == (2048 // c.u2_bo, c.u2_s) and s3 == (m, 5632, 2048, nb)
        assert g3[0] * g3[1] >= 128, (m, g3)                            # ~1 per SM of 132
        assert 2048 // c.u2_bo <= 32                                     # h read K_out / BO times
        assert (c3["BO"], c3["CD"], c3["MT"], c3["NT"], c3["DIRECT"], w3, st3) == (
            c.u2_bo, c.u2_cd, mt, mp // mt, False, c.u2_dwarps, c.u2_dstages)
        assert p.launch4[0] is decode_finish_kernel and p.uses_acc
        assert p.int_sizes == (nb * c.u2_bl, nb, 5632, m + 1)
        assert p.float_sizes[0] * 2 >= m * 5632                          # h in x's dtype, 2 per fp32 word
        # one split: y written by the down launch
        d = cuda_decode.prepare(m, 2048, 5632, 2048, "union2", c._replace(u2_s=1), True, False, False, False,
                                True, True)
        assert d.launch4 is None and not d.uses_acc and d.launch3[3]["DIRECT"] and d.launch3[1][1] == 1
    c = P.decode_config(256, 2048)._replace(u2_mr=64, u2_dense_up=True)
    p = cuda_decode.prepare(256, 2048, 5632, 2048, "union2", c, True, False, False, False, True, False)
    assert p.launch2[1][0] == 4 and p.launch2[3]["NT"] == 2                # 4 row groups of 2 tiles
    assert p.launch2[3]["DENSE_UP"] and not p.launch2[3]["UP_DOT"]
    assert p.launch2[3]["SK"] == 1 and p.split is None                     # no dot: no K split
    assert p.launch3[3]["NT"] == 8 and not p.launch4[3]["CLEAN"]
    p = cuda_decode.prepare(64, 2048, 5632, 2048, "union2", c._replace(u2_dense_up=False, u2_sk=64, u2_bk=128),
                            True, False, False, False, True, False)
    assert p.launch2[1][2] == 16 and p.launch2[2][-1] == 128               # at most K / BK splits
    # the most row groups (16 of 16 rows at 256) and the smallest chunks: every ticket zeroed
    p = cuda_decode.prepare(256, 2048, 5632, 2048, "union2", c._replace(u2_dense_up=False, u2_sk=2, u2_mr=16,
                                                                          u2_mt=32, u2_c=16),
                            True, False, False, False, True, False)
    nr, nc, _ = p.launch2[1]
    assert nr == 16 and nr * nc <= p.split.tickets == -(-5632 // c.u2_bl) * c.u2_bl
    p = cuda_decode.prepare(64, 2048, 5632, 2048, "union2", c, False, False, False, False, True, False)
    assert not p.launch2[3]["DENSE_UP"] and not p.launch2[3]["UP_DOT"]    # non-gated: no up projection


def test_union2_form_rejects_more_row_tiles_than_its_kernels_hold():
    from twell_compile.runtime import cuda_decode
    c = P.decode_config(256, 2048)._replace(u2_mt=16)            # 256 rows in 16 tiles of 16
    with pytest.raises(ValueError, match="cfg.u2_mt"):
        cuda_decode.prepare(256, 2048, 5632, 2048, "union2", c, True, False, False, False, True, True)
    cuda_decode.prepare(128, 2048, 5632, 2048, "union2", c, True, False, False, False, True, True)   # 8: held


@pytest.mark.parametrize("form", ["union", "union2"])
def test_union_form_through_the_ops_decode_entry_under_interpreter(form):
    """The op's CUDA entry (cuda_infer.ffn_infer) on a decode plan of the union or union2 form
    (what path="decode-union" / "decode-union2" plans on CUDA): y by the 2x rule, the layer's
    statistics from the kernels."""
    run_interpreted(textwrap.dedent(f"""
        import torch, torch.nn.functional as F
        import twell_compile
        from twell_compile.reference import ffn_dense
        from twell_compile.runtime import arch, cuda_infer, select
        torch.manual_seed(5)
        m, k, n, ko = 33, 64, 120, 40
        dt = torch.float16
        x = torch.randn(m, k).to(dt)
        wg, wu = (torch.randn(n, k) / 8).to(dt), (torch.randn(n, k) / 8).to(dt)
        wd = (torch.randn(ko, n) / 11).to(dt).t().contiguous().t()          # transposed storage
        bg, bu, bd = (torch.randn(n) * .1).to(dt), torch.randn(n).to(dt), torch.randn(ko).to(dt)
        args = (x, wg, bg, wu, bu, wd, bd)
        plan = select.InferPlan("decode", arch.H200, ("glue", x.device, x.dtype, k, n, ko, True), form={form!r})
        y = cuda_infer.ffn_infer(plan, *args, "glue", True)
        ref = ffn_dense(*(a.double() for a in args))
        err = ((y.double() - ref).norm() / ref.norm()).item()
        derr = ((ffn_dense(*args).double() - ref).norm() / ref.norm()).item()
        assert err <= 2 * derr + 1e-6, (err, derr)
        st = twell_compile.layer_stats()["glue"]
        nnz = (F.linear(x, wg, bg) > 0).sum(1)
        assert st.tokens == m and st.hidden == n
        assert abs(st.mean_nnz - float(nnz.float().mean())) <= 2 / m, (st, nnz)
        assert abs(st.max_nnz - int(nnz.max())) <= 1, (st, nnz)
        print("ok", err, derr)
    """))


def test_state_tail_holds_tickets_counters_and_sum():
    w = torch.nn.Parameter(torch.randn(6, 5))
    assert ds.register(w)
    tk, cnt, hs = ds.tail_parts(ds.decode_state(w.detach(), 3)[1])
    assert (tk.numel(), cnt.numel(), hs.numel()) == (ds.STATE_TICKETS, ds.STATE_ROWS, 1)
    tail = torch.arange(ds.tail_size(5), dtype=torch.int32)
    tk, cnt, hs = ds.tail_parts(tail)
    assert tk.tolist() == list(range(ds.STATE_TICKETS))
    assert cnt.numel() == 5 and int(cnt[0]) == ds.STATE_TICKETS
    assert hs.dtype == torch.float32 and hs.numel() == 1
    assert hs.view(torch.int32).item() == ds.STATE_TICKETS + 5


@pytest.mark.parametrize("case", CASES)
def test_decode_kernels_under_interpreter(case):
    run_interpreted(SCRIPT.format(seed=sum(case[:4]), case=case, act="relu", down_t=False))


@pytest.mark.parametrize("case", UNION_CASES)
def test_decode_union_form_under_interpreter(case):
    run_interpreted(SCRIPT.format(seed=sum(case[:4]), case=case[:10], act="relu", down_t=case[10]))


@pytest.mark.parametrize("case", UNION2_CASES)
def test_decode_union2_form_under_interpreter(case):
    run_interpreted(SCRIPT.format(seed=sum(case[:4]), case=case[:10], act="relu", down_t=case[10]))


# squared ReLU and dReLU in every form (rows, GEMV gate, tiles, list, list + udot, pairs, union, union2),
# gated and non-gated, NaN/Inf rows
@pytest.mark.parametrize("act, case", [("relu2", CASES[i]) for i in (0, 1, 2, 3, 12, 13, 18, 22, 23)]
                         + [("drelu", CASES[i]) for i in (0, 2, 4, 12, 18, 22)]
                         + [("relu2", UNION_CASES[i][:10]) for i in (1, 2)]
                         + [("drelu", UNION_CASES[i][:10]) for i in (5, 8)]
                         + [("relu2", UNION2_CASES[i][:10]) for i in (1, 2)]
                         + [("drelu", UNION2_CASES[i][:10]) for i in (5, 8, 10)])
def test_decode_activations_under_interpreter(act, case):
    run_interpreted(SCRIPT.format(seed=sum(case[:4]) + 3, case=case, act=act, down_t=False))


# ----------------------------------------------------------------------------- CPU: state, rule
def _forms(fixed: float, gbps: float, work: float, **override) -> dict:
    """Decode-form constants with the given fixed cost, W_gate rate and work coefficients; each
    form's strided term as shipped."""
    out = {f: (fixed, gbps) + (work,) * (len(c) - 3) + c[-1:] for f, c in P.decode_forms.items()}
    out.update(override)
    return out


# constants under which the decode path wins at density 0 for any shape: tests of the
# mechanism (the H200 constants pick decode only for large, sparse layers)
WINS_EVERYWHERE = dict(decode_forms=_forms(0.0, P.dense_gbps, 0.0), dense_fixed_us=1.0)
# a cost model under which decode wins while the union is small (the first H200 run's policy;
# the pairs form as shipped)
MECHANISM = dict(decode_forms={"rows": (4.5, 3500.0, 0.5, P.decode_forms["rows"][-1]),
                               "tiles": (5.0, 3500.0, 0.01, 0.01, P.decode_forms["tiles"][-1]),
                               "list": (6.0, 3500.0, 1.0, 0.01, P.decode_forms["list"][-1]),
                               "pairs": P.decode_forms["pairs"]},
                 dense_fixed_us=2.0, dense_gbps=3500.0)


@pytest.fixture
def decode_wins_everywhere():
    with arch.patched(**WINS_EVERYWHERE):
        yield


def test_union_fraction():
    assert select.union_fraction(0.005, 1) == pytest.approx(0.005)
    assert select.union_fraction(0.2, 64) > 0.999
    assert select.union_fraction(0.0, 64) == 0.0


def test_decode_cost_model_mechanism():
    # constants of the first H200 run's policy: decode wins while the union is small
    with arch.patched(**MECHANISM):
        p = arch.cuda_default()
    assert p.dense_fixed_us == 2.0 and arch.cuda_default() is not p     # patched only in the block
    assert select.decode_wins(p, 0.005, 1, 2048, 5632, 2048, True)
    assert select.decode_wins(p, 0.005, 16, 2048, 5632, 2048, True)
    assert not select.decode_wins(p, 1.0, 64, 2048, 5632, 2048, True)
    assert not select.decode_wins(p, 0.2, 64, 4096, 11008, 4096, True)
    assert not select.decode_wins(p, 0.0, 1, 64, 256, 64, True)      # tiny layer: fixed costs


def test_decode_form_rule():
    """Rows (one active neuron at a time) for few rows with few active neurons per program, the
    pairs form for more rows at low density, tiles where many neurons are active: whichever
    the fitted cost model predicts fastest."""
    vec_m = P.decode_configs[16].vec_m
    assert vec_m >= 1
    assert select.decode_form(P, 0.005, 1, 2048, 5632, 2048) == "rows"
    assert select.decode_form(P, 0.005, 16, 2048, 5632, 2048) == "pairs"
    assert select.decode_form(P, 0.005, 16, 4096, 11008, 4096) == "pairs"
    assert select.decode_form(P, 0.2, 4, 2048, 5632, 2048) == "tiles"
    assert "rows" not in select.decode_us(P, 0.0, vec_m + 1, 2048, 5632, 2048)    # no rows form
    t = select.decode_us(P, 0.05, 1, 2048, 5632, 2048)
    assert set(t) == {"rows", "tiles", "list", "pairs"} and min(t.values()) > 0
    lo = select.decode_us(P, 0.005, 1, 2048, 5632, 2048)
    assert all(t[f] > lo[f] for f in ("rows", "list", "pairs"))


def test_deterministic_mode_takes_the_form_without_atomics():
    """torch.use_deterministic_algorithms(True): the decode rule only considers the list form
    (fixed summation order), and still falls back to dense where that form cannot win."""
    assert select.decode_pick(P, 0.0, 16, 2048, 5632, 2048, True) == "pairs"
    # the list form reads W_down^T rows strided (no copy): at K=2048 it never beat dense on
    # the H200 grid (M=1 d=0.005: 46.6 vs 34.0 us), so deterministic decode runs dense
    assert select.DETERMINISTIC_FORMS == ("list",)
    assert select.decode_pick(P, 0.0, 16, 2048, 5632, 2048, True, select.DETERMINISTIC_FORMS) is None
    assert select.decode_form(P, 0.0, 16, 2048, 5632, 2048, ("list",)) == "list"
    assert not select.decode_wins(P, 0.2, 16, 2048, 5632, 2048, True, ("list",))


def test_decode_forward_rejects_bad_forms():
    from twell_compile.runtime.cuda_decode import decode_forward
    x = torch.zeros(8, 16)
    w = torch.zeros(32, 16)
    with pytest.raises(ValueError, match="form"):
        decode_forward(x, w, None, w, None, w.t().contiguous(), None, form="lists")
    with pytest.raises(ValueError, match="vec_m"):
        decode_forward(x, w, None, w, None, w.t().contiguous(), None, form="rows")
    with pytest.raises(ValueError, match="x2 in float16 or bfloat16"):
        decode_forward(x, w, None, w, None, w.t().contiguous(), None, form="union")
    with pytest.raises(ValueError, match="form='union2' takes x2 in float16 or bfloat16"):
        decode_forward(x, w, None, w, None, w.t().contiguous(), None, form="union2")


def test_static_reason_for_decode_sizes(decode_wins_everywhere):
    cuda = torch.device("cuda")
    p = arch.cuda_default()
    for m in (1, 16, p.decode_max_m, None):
        assert select.static_reason(cuda, torch.bfloat16, m, 2048, 5632, 2048) is None
    mid = select.static_reason(cuda, torch.bfloat16, p.decode_max_m + 1, 2048, 5632, 2048)
    assert mid and f"{p.decode_max_m + 1} tokens" in mid and "decode" in mid
    # the decode path takes any width; the per-row path does not
    assert select.static_reason(cuda, torch.float16, 1, select.MAX_WIDTH + 1, 64, 64) is None
    assert "wide" in select.static_reason(cuda, torch.float16, p.min_tokens, select.MAX_WIDTH + 1, 64, 64)
    assert "float32" in select.static_reason(cuda, torch.float32, 1, 2048, 5632, 2048)
    # where decode cannot win even at density 0 (here: fixed costs far above dense's), a static
    # decode-sized FFN stays with Inductor; a dynamic one is rewritten and decided per call
    with arch.patched(decode_forms=_forms(1e3, P.dense_gbps, 0.0)):
        why = select.static_reason(cuda, torch.bfloat16, 1, 256, 1024, 256)
        assert why and "1 tokens" in why and "decode" in why
        assert select.static_reason(cuda, torch.bfloat16, None, 256, 1024, 256) is None


def test_shipped_constants_rewrite_the_measured_decode_shape():
    assert select.static_reason(torch.device("cuda"), torch.bfloat16, 1, 2048, 5632, 2048) is None


def _reserves_decode_state(model: GatedMLP, x: torch.Tensor) -> bool:
    """Compile ``model`` at ``x`` through the passes, run the backend's compile-time hook on the
    rewritten graph: whether the FFN's W_down parameter now holds a decode state."""
    from twell_compile import backend
    from twell_compile.config import TwellConfig
    from twell_compile.passes import run_passes

    captured = {}

    def grab(gm, example_inputs):
        captured["gm"], captured["inputs"] = run_passes(gm, TwellConfig(skip_dense=False)), example_inputs
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=grab)(x)
    ds.clear()
    backend.reserve_decode_state(captured["gm"], captured["inputs"])
    return ds.decode_state(model.down.weight, 1) is not None


# ----------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
DT = [torch.bfloat16, torch.float16]


@gpu
def test_backend_registers_w_down_of_rewritten_ffns():
    """The compile-time hook finds the real W_down parameter behind each rewritten FFN whose
    decode path can win (select.decode_state_wanted), and none where it cannot (a record whose
    decode forms cost 1 ms fixed)."""
    torch.manual_seed(0)
    model = GatedMLP().cuda().to(torch.bfloat16)
    x = torch.randn(4, 16, device="cuda", dtype=torch.bfloat16)
    assert _reserves_decode_state(model, x)
    with arch.patched(decode_forms=_forms(1e3, P.dense_gbps, 0.0)):      # decode can never win
        assert not _reserves_decode_state(model, x)
    ds.clear()


def _ffn(m, k, n, k_out, density, dtype, gated=True, bias=True, tail=0.0, seed=None):
    return ffn_with_biases(m, k, n, k_out, density, tail, dtype=dtype, gated=gated, bias=bias, seed=seed)


def _check(p, cfg=None, form=None):
    from twell_compile.reference import ffn_dense
    from twell_compile.runtime.cuda_decode import decode_forward
    args = _args(p)
    _poison()
    y, tok, hsum = decode_forward(*args, cfg=None if cfg is None else arch.DecodeConfig(*cfg), form=form)
    ref = ffn_dense(*(None if a is None else a.float() for a in args))
    eager = ffn_dense(*args)
    assert torch.isfinite(y).all(), "unwritten or non-finite output"
    err, derr = _rel(y, ref), _rel(eager, ref)
    assert err <= 2 * derr + 1e-6, f"rel err {err:.3e} > 2x eager's {derr:.3e}"
    hg = torch.relu(F.linear(p["x"], p["w_gate"], p["b_gate"]))
    cnt = (hg != 0).sum(1)
    m = p["x"].shape[0]
    assert (tok[:m] - cnt).abs().sum() <= 0.002 * cnt.sum() + 2   # g rounding at 0 may differ
    assert int(tok[m]) == int(tok[:m].sum())
    return y


@gpu
@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("m", [1, 2, 5, 16, 33, 64])
@pytest.mark.parametrize("density", [0.0, 0.005, 0.05, 0.3, 1.0])
def test_decode_grid(m, density, dtype):
    _check(_ffn(m, 512, 1408, 512, density, dtype))


@gpu
@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("m", [1, 3, 16, 33, 64])
@pytest.mark.parametrize("density", [0.0, 0.005, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("tail", [0.0, 0.5])
@pytest.mark.parametrize("form", ["list", "pairs"])
def test_decode_list_and_pairs_form_grid(m, density, tail, dtype, form):
    from twell_compile.runtime.cuda_decode import decode_forward
    p = _ffn(m, 512, 1408, 520, density, dtype, tail=tail)
    registered = form == "pairs" and m % 2 == 1        # the persistent accumulator
    if registered:
        assert ds.register(p["w_down"])
    y = _check(p, form=form)
    if form == "list":
        assert torch.equal(y, decode_forward(*_args(p), form="list").y), "list form not deterministic"
    else:
        _check(p, form=form)                           # a second call: the state was zeroed
    if registered:
        acc, tk = ds.decode_state(p["w_down"], m)
        assert not acc.any(), "persistent accumulator not zero after the call"
    ds.clear()


@gpu
@pytest.mark.parametrize("cfg", [(32, 128, 256, 256, 0, 0, 4, 3, 2, 1024, 16, 128, 8, 16),
                                 (64, 256, 256, 256, 0, 0, 8, 2, 8, 4096, 64, 512, 4, 64),
                                 (32, 128, 128, 256, 0, 0, 4, 3, 4, 2048, 32, 128, 4, 64, True, 256, 5),
                                 (32, 256, 256, 256, 0, 0, 4, 3, 4, 2048, 64, 128, 4, 16, False, 128, 4, 2048),
                                 (32, 128, 256, 256, 0, 0, 8, 3, 8, 1024, 64, 128, 4, 32, True, 128, 5, 512)])
@pytest.mark.parametrize("m", [2, 16, 40])
@pytest.mark.parametrize("k,n,k_out", [(2048, 5632, 2048), (4096, 11008, 4096), (100, 3000, 4100)])
@pytest.mark.parametrize("form", ["list", "pairs"])
def test_decode_list_and_pairs_form_configs_and_shapes(cfg, m, k, n, k_out, form):
    _check(_ffn(m, k, n, k_out, 0.02, torch.bfloat16, tail=0.2), cfg, form=form)


def _down_layout(p: dict, layout: str) -> dict:
    """W_down as nn.Linear stores it ("linear"), or stored [N, K_out] ("transposed": w_down.t()
    contiguous, as prepare(down_layout="transposed") stores it); same values."""
    if layout == "transposed":
        p["w_down"] = p["w_down"].t().contiguous().t()
    return p


@gpu
@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("m", [16, 17, 33, 64, 128, 256])
@pytest.mark.parametrize("density", [0.0, 0.005, 0.3, 1.0])
@pytest.mark.parametrize("layout", ["linear", "transposed"])
@pytest.mark.parametrize("form", ["union", "union2"])
def test_decode_union_form_grid(m, density, layout, dtype, form):
    """The union and union2 forms against fp32 with the 2x rule, twice per input (the persistent
    state zero again after each call), statistics as the pairs form's; W_down in both storages."""
    from twell_compile.runtime.cuda_decode import decode_forward
    p = _down_layout(_ffn(m, 512, 1408, 520, density, dtype, tail=0.2), layout)
    registered = m % 2 == 1 and m <= ds.STATE_ROWS
    if registered:
        assert ds.register(p["w_down"])
    y = _check(p, form=form)
    _check(p, form=form)
    _, tok, hsum = decode_forward(*_args(p), form=form)
    _, tok2, hsum2 = decode_forward(*_args(p), form="pairs")
    assert (tok - tok2).abs().sum() <= 2 and abs(float(hsum) - float(hsum2)) <= 1e-3 * abs(float(hsum2)) + 1e-3
    if registered:
        acc, tail = ds.decode_state(p["w_down"], m)
        assert not acc.any() and not tail.any(), "persistent state not zero after the call"
    if density == 0.0:
        assert torch.equal(y, p["b_down"].expand_as(y))
    ds.clear()


@gpu
@pytest.mark.parametrize("fields", [dict(), dict(union_s=1), dict(union_s=8, union_c=32), dict(union_mb=32),
                                    dict(union_bn=16, union_bo=16, union_c=128),
                                    dict(union_bk=128, union_warps=8, union_dwarps=8, union_dstages=3)])
@pytest.mark.parametrize("m", [16, 64, 129, 256])
@pytest.mark.parametrize("k,n,k_out", [(2048, 5632, 2048), (4096, 11008, 4096), (100, 3000, 4100)])
@pytest.mark.parametrize("layout", ["linear", "transposed"])
def test_decode_union_form_configs_and_shapes(fields, m, k, n, k_out, layout):
    """Union-form configs (one split: y written directly; row tiles; other block sizes) at the
    measured shapes and an odd one."""
    from twell_compile.runtime.cuda_decode import config_for
    p = _down_layout(_ffn(m, k, n, k_out, 0.005, torch.bfloat16, tail=0.2), layout)
    _check(p, config_for(m, k, p["x"].device)._replace(**fields), form="union")


@gpu
@pytest.mark.parametrize("fields", [dict(), dict(u2_s=1), dict(u2_mr=32, u2_s=16, u2_cd=64),
                                    dict(u2_c=16, u2_bo=64, u2_cd=16, u2_bk=64, u2_stages=4),
                                    dict(u2_c=64, u2_bo=256, u2_warps=8, u2_dwarps=8, u2_dstages=3),
                                    dict(u2_mt=16, u2_bl=128, u2_dense_up=True),
                                    dict(u2_sk=8, u2_c=16, u2_mr=32), dict(u2_sk=3, u2_bk=64, u2_cd=128)])
@pytest.mark.parametrize("m", [16, 64, 129, 256])
@pytest.mark.parametrize("k,n,k_out", [(2048, 5632, 2048), (4096, 11008, 4096), (100, 3000, 4100)])
@pytest.mark.parametrize("layout", ["linear", "transposed"])
def test_decode_union2_form_configs_and_shapes(fields, m, k, n, k_out, layout):
    """Union2-form configs (one split: y written directly; row groups; other tile sizes; 16-row
    tiles; the dense up projection; K split in the up launch, with row groups, and uneven: 3
    splits of K) at the measured shapes and an odd one."""
    from twell_compile.runtime.cuda_decode import config_for
    c = config_for(m, k, torch.device("cuda"))._replace(**fields)
    if max(16, arch.next_pow2(m)) // min(c.u2_mt, max(16, arch.next_pow2(m))) > 8:
        pytest.skip("more row tiles than the union2 kernels hold (ValueError: test_union2_form_rejects_...)")
    p = _down_layout(_ffn(m, k, n, k_out, 0.005, torch.bfloat16, tail=0.2), layout)
    _check(p, c, form="union2")


@gpu
@pytest.mark.parametrize("m", [16, 64, 128])
@pytest.mark.parametrize("sk", [1, 4])
def test_decode_union2_with_one_union_share_gives_the_same_bits_each_call(m, sk):
    """With one share of the union (u2_s=1: y written by the down launch, no atomics) y sums in a
    fixed order, the up launch's K splits included (each chunk's last program adds the partials
    in split order, whichever program arrives last): repeated calls give identical bits."""
    from twell_compile.runtime.cuda_decode import config_for, decode_forward
    p = _down_layout(_ffn(m, 2048, 5632, 2048, 0.02, torch.bfloat16, tail=0.2), "transposed")
    c = config_for(m, 2048, p["x"].device)._replace(u2_s=1, u2_sk=sk)
    y = decode_forward(*_args(p), cfg=c, form="union2").y
    for _ in range(3):
        assert torch.equal(decode_forward(*_args(p), cfg=c, form="union2").y, y)
    _check(p, c, form="union2")


@gpu
@pytest.mark.parametrize("m", [16, 64, 256])
@pytest.mark.parametrize("layout", ["linear", "transposed"])
@pytest.mark.parametrize("path", ["decode-union", "decode-union2"])
def test_op_forced_decode_union_path(m, layout, path):
    """path="decode-union" / "decode-union2" through the op, and twell.path likewise through
    torch.compile (the decode rule never picks these forms itself): y by the 2x rule, the
    layer's statistics."""
    import twell_compile
    from twell_compile.reference import ffn_dense
    from twell_compile.runtime import density
    density.reset()
    ds.clear()
    p = _down_layout(_ffn(m, 2048, 5632, 2048, 0.005, torch.bfloat16), layout)
    args = _args(p)
    ref = ffn_dense(*(None if a is None else a.float() for a in args))
    derr = _rel(ffn_dense(*args), ref)
    for i in range(3):                              # eager, then the op's own graph replayed
        _poison()
        y = torch.ops.twell.ffn(*args, "union_op", True, path=path)
        assert torch.isfinite(y).all() and _rel(y, ref) <= 2 * derr + 1e-6, i
    st = twell_compile.layer_stats()["union_op"]
    nnz = (F.linear(p["x"], p["w_gate"], p["b_gate"]) > 0).sum(1)
    assert st.tokens == m and abs(st.mean_nnz - float(nnz.float().mean())) <= 0.01 * float(nnz.float().mean()) + 1
    model = GatedMLP(2048, 5632, bias=True).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for name in ("gate", "up", "down"):
            getattr(model, name).weight.copy_(p[f"w_{name}"])
            getattr(model, name).bias.copy_(p[f"b_{name}"])
        if layout == "transposed":
            model.down.weight.data = model.down.weight.detach().t().contiguous().t()
        f = torch.compile(model, backend="twell", options={"twell.path": path})
        y = f(p["x"])
        eager = model(p["x"])
        ref = copy.deepcopy(model).float()(p["x"].float())     # (Module.float() casts in place)
        assert _rel(y, ref) <= 2 * _rel(eager, ref) + 1e-6
    ds.clear()
    density.reset()


@gpu
@pytest.mark.parametrize("cfg", [(32, 256, 256, 128, 0, 8192, 4, 3), (16, 64, 64, 64, 4, 0, 4, 2),
                                 (64, 128, 512, 256, 16, 1 << 20, 8, 3)])
@pytest.mark.parametrize("m", [1, 16, 40])
@pytest.mark.parametrize("density", [0.005, 0.3])
@pytest.mark.parametrize("registered", [False, True])
def test_decode_configs(cfg, m, density, registered):
    # in-kernel finish (last program) or a finishing launch; fresh or persistent accumulator
    p = _ffn(m, 2048, 5632, 2048, density, torch.bfloat16, tail=0.2)
    if registered:
        ds.register(p["w_down"])
    for _ in range(2):
        _check(p, cfg)
        if registered:
            acc, tk = ds.decode_state(p["w_down"], m)
            assert not acc.any() and not tk.any(), "persistent state not zero after the call"
    ds.clear()


@gpu
def test_decode_writes_the_layer_statistics_buffer():
    from twell_compile.runtime.cuda_decode import decode_forward
    p = _ffn(5, 512, 1408, 512, 0.05, torch.bfloat16)
    st = torch.full((4,), float("nan"), dtype=torch.float64, device="cuda")
    y, tok, hsum = decode_forward(*_args(p), stats_buf=st)
    hg = torch.relu(F.linear(p["x"], p["w_gate"], p["b_gate"]))
    h = (hg * F.linear(p["x"], p["w_up"], p["b_up"])).double()
    assert st[0] == tok[5] and st[1] == tok[:5].max() and st[3] == 0
    assert abs(float(st[0]) - float((hg != 0).sum())) <= 0.002 * float((hg != 0).sum()) + 2
    assert abs(float(st[2]) - float(h.abs().sum())) <= 1e-2 * float(h.abs().sum())


@gpu
@pytest.mark.parametrize("m,k,n,k_out,gated,bias", [
    (1, 2048, 5632, 2048, True, False),
    (3, 4096, 11008, 4096, True, False),
    (7, 129, 1001, 77, False, True),
    (16, 33, 130, 17, True, True),
    (64, 200, 5000, 136, True, True),
    (2, 8200, 300, 9000, False, False),     # wider than the per-row path allows
])
def test_decode_odd_shapes(m, k, n, k_out, gated, bias):
    _check(_ffn(m, k, n, k_out, 0.05, torch.bfloat16, gated=gated, bias=bias, tail=0.5))


@gpu
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("form", [None, "list", "pairs", "union", "union2"])
def test_decode_nan_inf_propagate_like_eager(gated, bad, form):
    from twell_compile.runtime.cuda_decode import decode_forward
    from twell_compile.reference import ffn_dense
    p = _ffn(9, 256, 1000, 256, 0.01, torch.bfloat16, gated=gated)
    p["x"][2, 5] = bad
    p["x"][7, 0] = bad
    args = _args(p)
    _poison()
    y = decode_forward(*args, form=form).y
    eager = ffn_dense(*args)
    assert torch.equal(torch.isnan(y), torch.isnan(eager))
    assert torch.equal(torch.isinf(y), torch.isinf(eager))
    fin = torch.isfinite(p["x"]).all(1)
    ref = ffn_dense(*(None if a is None else a[fin].float() if i == 0 else a.float() for i, a in enumerate(args)))
    assert _rel(y[fin], ref) <= 2 * _rel(eager[fin], ref) + 1e-6


@gpu
def test_decode_repeatable_and_fresh_inputs():
    """Same inputs twice agree up to the fp32 atomics' summation order (no race); fresh inputs
    each give a right answer."""
    from twell_compile.runtime.cuda_decode import decode_forward
    for _ in range(3):
        p = _ffn(16, 1024, 2816, 1024, 0.01, torch.bfloat16)
        a = decode_forward(*_args(p)).y
        b = decode_forward(*_args(p)).y
        assert _rel(a, b) < 4e-3            # at most last-bit flips of bf16 outputs
        _check(p)


@gpu
@pytest.mark.parametrize("m,registered,form", [(4, True, None), (1, True, None), (4, False, None), (40, True, None),
                                               (16, True, "list"), (40, False, "list"),
                                               (16, True, "pairs"), (40, False, "pairs"), (3, True, "pairs"),
                                               (17, True, "union"), (64, False, "union"), (200, False, "union"),
                                               (17, True, "union2"), (64, True, "union2"), (200, False, "union2")])
def test_decode_cuda_graph_capture_and_replay_with_new_inputs(m, registered, form):
    """Replays with fresh inputs, interleaved with eager calls on the same weights: every result
    within the error rule (the persistent accumulator stays zero between calls)."""
    from twell_compile.runtime.cuda_decode import decode_forward
    from twell_compile.reference import ffn_dense
    ds.clear()
    p = _ffn(m, 1024, 2816, 1024, 0.01, torch.bfloat16)
    if registered:
        assert ds.register(p["w_down"])
    args = list(_args(p))
    static_x = args[0].clone()
    args[0] = static_x
    decode_forward(*args, form=form)                  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_forward(*args, form=form).y

    def ok(y, a):
        ref = ffn_dense(*(None if t is None else t.float() for t in a))
        return _rel(y, ref) <= 2 * _rel(ffn_dense(*a), ref) + 1e-6

    for i in range(12):
        fresh = _ffn(m, 1024, 2816, 1024, 0.01, torch.bfloat16)["x"]
        static_x.copy_(fresh)
        out.fill_(float("nan"))
        graph.replay()
        assert ok(out, args), f"replay {i}"
        if i % 3 == 2:                                # an eager call in between
            other = [fresh * 0.5 if j == 0 else a for j, a in enumerate(args)]
            assert ok(decode_forward(*other, form=form).y, other), f"eager call after replay {i}"
    if registered:
        torch.cuda.synchronize()
        acc, tk = ds.decode_state(p["w_down"], m)
        assert not acc.any() and not tk.any()
    ds.clear()


@gpu
def test_weight_updates_are_seen_by_calls_and_graph_replays():
    from twell_compile.runtime.cuda_decode import decode_forward
    from twell_compile.reference import ffn_dense
    ds.clear()
    p = _ffn(2, 512, 1408, 512, 0.01, torch.bfloat16)
    wd = nn.Parameter(p["w_down"], requires_grad=False)
    p["w_down"] = wd
    assert ds.register(wd)
    args = _args(p)

    def ok(y):
        ref = ffn_dense(*(None if a is None else a.float() for a in args))
        return _rel(y, ref) <= 2 * _rel(ffn_dense(*args), ref) + 1e-6

    assert ok(decode_forward(*args).y)
    with torch.no_grad():
        wd.mul_(-0.5)
    assert ok(decode_forward(*args).y)
    wd.data.mul_(3.0)                                  # no version bump: nothing cached to miss it
    assert ok(decode_forward(*args).y)
    # graph replays read the weight itself: any update is seen, with nothing to refresh
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_forward(*args).y
    with torch.no_grad():
        wd.add_(0.01)
    wd.data[:10].zero_()
    out.fill_(float("nan"))
    graph.replay()
    assert ok(out)
    ds.clear()


@gpu
def test_op_plan_by_m_and_density():
    """M <= decode_max_m runs the decode kernels where the rule says so (before any
    measurement: at density 0); the lagged density then switches a busy layer at M = 64 to
    dense; M between the paths runs dense. Constants of the first H200 run's policy (under
    the shipped ones every point here runs dense). The path each call took: the layer's
    record (density.snapshot)."""
    from twell_compile.reference import ffn_dense
    from twell_compile.runtime import density
    density.reset()
    for m, d, want in ((1, 0.005, [True, True]), (64, 0.5, [True, False]), (300, 0.005, [False, False])):
        p = _ffn(m, 2048, 5632, 2048, d, torch.bfloat16)
        for want_decode in want:
            with arch.patched(**MECHANISM):
                y = torch.ops.twell.ffn(*_args(p), f"disp{m}", True)
            torch.cuda.synchronize()
            # (a dense call past the decode sizes records no path: the layer is absent)
            assert (last_paths().get(f"disp{m}") == {"decode"}) == want_decode, (m, d, last_paths())
            ref = ffn_dense(*(None if a is None else a.float() for a in _args(p)))
            assert _rel(y, ref) <= 2 * _rel(ffn_dense(*_args(p)), ref) + 1e-6
    import twell_compile
    st = twell_compile.layer_stats()["disp1"]
    assert st.tokens == 1 and st.hidden == 5632


@gpu
def test_op_in_deterministic_mode_repeats_its_bits():
    """Under torch.use_deterministic_algorithms the decode op takes the list form or dense
    (at K=2048 the list form, reading W_down^T strided, never wins: dense), never a form with
    atomics nor a dense call replayed from a graph: the same inputs give the same bits on every
    call."""
    from twell_compile.reference import ffn_dense
    from twell_compile.runtime import density
    density.reset()
    p = _ffn(16, 2048, 5632, 2048, 0.005, torch.bfloat16)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        ys = [torch.ops.twell.ffn(*_args(p), "det16", False) for _ in range(4)]
    finally:
        torch.use_deterministic_algorithms(was)
    assert all(torch.equal(ys[0], y) for y in ys[1:])
    ref = ffn_dense(*(None if a is None else a.float() for a in _args(p)))
    assert _rel(ys[0], ref) <= 2 * _rel(ffn_dense(*_args(p)), ref) + 1e-6
    density.reset()


@gpu
def test_compile_reduce_overhead_decode(decode_wins_everywhere):
    from torch._dynamo.utils import counters
    from twell_compile.runtime import density
    density.reset()
    ds.clear()
    counters.clear()
    model = GatedMLP.at_density(512, 1408, 0.01).cuda().to(torch.bfloat16)
    f = torch.compile(model, backend="twell", mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
            x[:, 0] = 1.0
            y = f(x).clone()
            torch.cuda.synchronize()
        ref = model.float()(x.float())
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert "decode" in set().union(*last_paths().values()), ("the decode kernels were not used", last_paths())
    # the decode state, made at compile time (no weight copy)
    assert ds.state_bytes() == (ds.STATE_ROWS * 512 + ds.STATE_TAIL) * 4
    assert _rel(y, ref) < 2e-2
    ds.clear()


@gpu
def test_static_decode_ffn_is_rewritten_only_with_cuda_graphs(decode_wins_everywhere):
    """Default mode (no CUDA graphs): a static 1-token FFN stays with Inductor, with the reason;
    reduce-overhead, or twell.cudagraphs='on' for graphs captured by hand: rewritten."""
    import twell_compile

    model = GatedMLP.at_density(512, 1408, 0.01).cuda().to(torch.bfloat16)
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        plain = twell_compile.explain(model, x)
        assert not plain.rewrites and "without CUDA graphs" in str(plain)
        for options in ({"twell.mode": "reduce-overhead"}, {"twell.cudagraphs": "on"}):
            torch._dynamo.reset()
            assert len(twell_compile.explain(model, x, options=options).rewrites) == 1, options
