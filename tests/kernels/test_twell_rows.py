"""The per-row TwELL kernels (kernels/twell_rows.py, through runtime/cuda_infer.py's launchers)
on the CPU under TRITON_INTERPRET=1, tiny shapes (one subprocess each,
since the interpreter is chosen when the kernels are defined). fp16 only: the Triton 3.9
interpreter's bf16 tl.dot returns garbage (seen here: 2.8e10 error on a 16x16 product)."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from twell_compile.runtime.cuda_infer import fused_rows, gate_rows, twell_forward
    from twell_compile.reference import activate, ffn_dense
    from twell_compile.runtime import arch
    PATCH = arch.patched(**{launch})       # the row kernel's launch variant, for this process (held:
    PATCH.__enter__()                      # a context manager nothing refers to is closed at once)
    assert all(getattr(arch.launch_policy('cpu'), f) == v for f, v in {launch}.items())
    torch.manual_seed({seed})
    m, k, n, ko, gated, bias, width, bad = {case}
    act = {act!r}
    dt = torch.float16
    x = torch.randn(m, k).to(dt)
    wg = (torch.randn(n, k) / k ** .5).to(dt)
    bg = (torch.randn(n) - 1.0).to(dt) if bias else None
    wu = (torch.randn(n, k) / k ** .5).to(dt) if gated else None
    bu = torch.randn(n).to(dt) if bias and gated else None
    wd = (torch.randn(ko, n) / n ** .5).to(dt)
    bd = torch.randn(ko).to(dt) if bias else None
    if bad:
        x[1, 3] = float("nan"); x[2, 0] = float("inf")
    args = (x, wg, bg, wu, bu, wd, bd)
    hg = torch.relu(F.linear(x, wg, bg))
    # list width ``width``: rows over it take the exact tail over g
    torch.empty(4 * m * (n + ko)).to(dt).fill_(float("nan"))    # poison freed memory
    # the plan's choice to split (select.splits_rows), taken where the variant names a split
    split = {launch}.get("row_split", 1) > 1
    y, counts, hsum = twell_forward(*args, width, act, split=split)
    want_hsum = activate(hg.float(), F.linear(x, wu, bu).float() if gated else None, act).abs().sum(1)
    fin_rows = torch.isfinite(x).all(1) & torch.isfinite(want_hsum)
    assert torch.allclose(hsum[fin_rows], want_hsum[fin_rows], rtol=2e-2, atol=1e-2), (hsum, want_hsum)
    assert torch.equal(counts, (hg != 0).sum(1).int()), "counts"
    r = gate_rows(x, wg, bg, width, split=split)
    pol = arch.launch_policy('cpu')
    assert r.tick.numel() == (pol.split_rows(m) if split else 0), "split rows' counters"
    assert not r.tick.any(), "split rows' counters start at zero"
    o = r.rows_in_order().long()      # the row kernels' order
    if split:
        # the case splits a row: among its first H rows in order, in buckets that end within
        # them, one over the cut
        h = pol.split_rows(m)
        ends = r.ctr.long().cumsum(0)
        whole = ends[torch.bucketize(torch.arange(h), ends, right=True)] <= h
        nl = torch.where(torch.isfinite(x[o[:h]]).all(1), counts[o[:h]].clamp(max=width), 0).long()
        seg = pol.row_split_pairs
        parts = torch.where(whole & (nl > seg), (-(-nl // seg)).clamp(max=pol.row_split), 1)
        parts = torch.where(parts > 1, -(-nl // (-(-nl // parts)).clamp(min=1)), 1)      # none empty
        if h == m:
            assert (parts > 1).any(), ("no row split", nl, whole)
        # and y's bits do not depend on the order of the rows within a bucket (the compaction's
        # atomics set it on a GPU): each bucket's rows reversed, counters zeroed
        order = r.order.clone()
        for b, c in enumerate(r.ctr.tolist()):
            order[b * m: b * m + c] = r.order[b * m: b * m + c].flip(0)
        y1 = fused_rows(x, r, wu, bu, wd, bd, act)[0]
        # a split row's parts each took a ticket; no other row's counter moved
        assert torch.equal(r.tick.long(), torch.where(parts > 1, parts, 0)), ("split rows", r.tick, parts, whole)
        y2 = fused_rows(x, r._replace(order=order, tick=torch.zeros_like(r.tick)), wu, bu, wd, bd, act)[0]
        assert torch.equal(torch.isnan(y1), torch.isnan(y2)) and torch.equal(y1.nan_to_num(), y2.nan_to_num()), \
            "y depends on the order within a bucket"
    assert torch.equal(o.sort().values, torch.arange(m)), ("order: a permutation", o)
    nb, c = r.ctr.numel(), counts.long()
    want = torch.where(c > width, 0, 1 + ((nb - 2) - c * (nb - 1) // (width + 1)).clamp(min=0)) if nb > 1 else 0 * c
    assert torch.equal(want[o], want[o].sort(stable=True).values), ("order: heaviest bucket first", want[o])
    assert torch.equal(r.ctr.long(), torch.bincount(want, minlength=nb)), ("bucket sizes", r.ctr, want)
    eager = ffn_dense(*args, act)
    assert torch.equal(torch.isnan(y), torch.isnan(eager)), "nan pattern"
    fin = torch.isfinite(x).all(1)
    ref = ffn_dense(*(None if a is None else a[fin].double() if i == 0 else a.double()
                      for i, a in enumerate(args)), act)
    err = ((y[fin].double() - ref).norm() / ref.norm()).item()
    derr = ((eager[fin].double() - ref).norm() / ref.norm()).item()
    assert err <= 2 * derr + 1e-6, (err, derr)
    print("ok", err, derr, int((counts > width).sum()))
""")

CASES = [
    # m, k, n, k_out, gated, bias, list width, nan/inf rows
    (5, 40, 100, 24, True, True, 4, False),    # odd N, K_out != K, rows over the list width
    (3, 40, 70, 40, False, False, 2, False),   # non-gated, most rows over the width: the tail
    (4, 40, 70, 40, True, True, 4, True),      # NaN and Inf rows
    (1, 33, 130, 17, True, False, 32, False),  # M = 1
    (6, 40, 300, 40, True, True, 64, False),   # lists wide enough for most rows
    (40, 24, 60, 24, True, False, 4, False),   # several compaction programs (16 rows each)
]


@pytest.mark.parametrize("case", CASES)
def test_kernels_under_interpreter(case):
    run_interpreted(SCRIPT.format(seed=sum(case[:4]), case=case, launch={}, act="relu"), timeout=60)


# the software-pipelined list loop (row_prefetch 3: Triton's pipeliner keeps row_stages - 1 pairs'
# weight rows in flight), one and two pairs per step, on the cases with lists and tails
@pytest.mark.parametrize("launch", [dict(row_prefetch=3, row_stages=3),
                                    dict(row_prefetch=3, row_stages=2, row_pairs=2)])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]])
def test_pipelined_list_loop_under_interpreter(case, launch):
    run_interpreted(SCRIPT.format(seed=sum(case[:4]) + 1, case=case, launch=launch, act="relu"), timeout=60)


# the row order in one bucket (program p takes the p-th row) and in eight (heaviest first; with
# the compaction's column loop pipelined)
@pytest.mark.parametrize("launch", [dict(row_buckets=1), dict(row_buckets=8, compact_stages=3)])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5]])
def test_row_buckets_under_interpreter(case, launch):
    run_interpreted(SCRIPT.format(seed=sum(case[:4]) + 2, case=case, launch=launch, act="relu"), timeout=60)


# split rows: the first row_split_rows rows in order take row_split programs each, a row among
# them over row_split_pairs listed pairs, in a bucket that ends within them, cut in even parts
# whose fp32 sums the last part adds (3 rows in eight buckets: a bucket cut by the bound stays
# whole; every row a candidate in one bucket or in eight, the pipelined list loop with two pairs
# per step; rows over the width keep their exact tail in part 0; NaN/Inf rows). Checked: y, the
# parts that met per row (the counters), y's bits with each bucket's rows in reverse order
@pytest.mark.parametrize("launch", [dict(row_split=4, row_split_pairs=2, row_split_rows=3, row_buckets=8),
                                    dict(row_split=3, row_split_pairs=1, row_split_rows=64, row_buckets=1),
                                    dict(row_split=2, row_split_pairs=3, row_split_rows=64, row_buckets=8,
                                         row_prefetch=3, row_stages=3, row_pairs=2)])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4], CASES[5]])
def test_split_rows_under_interpreter(case, launch):
    run_interpreted(SCRIPT.format(seed=sum(case[:4]) + 6, case=case, launch=launch, act="relu"), timeout=60)


# W_down^T made by the compaction's launch (tiles after its programs): every case, one with the
# pipelined column loop
@pytest.mark.parametrize("launch", [dict(compact_transpose=True)])
@pytest.mark.parametrize("case", CASES)
def test_compaction_launch_transposes_w_down_under_interpreter(case, launch):
    run_interpreted(SCRIPT.format(seed=sum(case[:4]) + 4, case=case, launch=launch, act="relu"), timeout=60)


def test_compaction_launch_transposes_w_down_with_pipelined_loads_under_interpreter():
    launch = dict(compact_transpose=True, compact_stages=3, row_buckets=8)
    run_interpreted(SCRIPT.format(seed=5, case=CASES[5], launch=launch, act="relu2"), timeout=60)


# squared ReLU (gated and not) and dReLU: h formed from the listed relu(g) and u, in the list
# loop and the exact tail, NaN/Inf rows included; counts stay relu(g)'s
@pytest.mark.parametrize("act, case", [("relu2", CASES[0]), ("relu2", CASES[1]), ("relu2", CASES[2]),
                                       ("drelu", CASES[0]), ("drelu", CASES[2]), ("drelu", CASES[5])])
def test_activations_under_interpreter(act, case):
    run_interpreted(SCRIPT.format(seed=sum(case[:4]) + 2, case=case, launch={}, act=act), timeout=60)


MERGE_SCRIPT = textwrap.dedent("""
    import torch
    from twell_compile.reference import pack_tiles
    from twell_compile.runtime.cuda_infer import compact_rows, merge_rows
    from twell_compile.runtime import arch
    PATCH = arch.patched(**{launch})       # held: a context manager nothing refers to is closed at once
    PATCH.__enter__()
    assert all(getattr(arch.launch_policy('cpu'), f) == v for f, v in {launch}.items())
    torch.manual_seed({seed})
    m, n, tile_n, slots, width, nb, dense_rows = {case}
    g = torch.randn(m, n).to(torch.float16) - 1.2       # ~12% of relu(g) non-zero
    g[:dense_rows] = g[:dense_rows].abs()                 # whole rows active: tiles over their slots
    g[m // 2, 3] = float("nan")
    g[m // 2 + 1, 5] = float("-inf")                      # non-finite, not a non-zero of relu
    tcnt, packed = pack_tiles(g, tile_n, slots)
    packed = torch.where(packed == -1, torch.randint_like(packed, 1 << 30), packed)  # poison the unwritten slots
    want = compact_rows(g, width, buckets=nb)
    gin = g.clone()
    if {spills}:
        # the gate GEMM's g="spills": only row tiles over their slots or holding a non-finite
        # value written; the rest poisoned (positive, so a read of it would list or add it)
        t = tcnt.shape[1]
        pad = torch.zeros(m, t * tile_n, dtype=g.dtype)
        pad[:, :n] = g
        tiles = pad.view(m, t, tile_n)
        kept = (tcnt > slots) | (~torch.isfinite(tiles)).any(2)
        poison = torch.rand(m, t, tile_n).to(g.dtype) + 0.5
        gin = torch.where(kept[:, :, None], tiles, poison).reshape(m, -1)[:, :n].contiguous()
    wd = torch.randn(70, 150).to(g.dtype)                # W_down^T written by the same launch (spills case)
    wdt = torch.full((150, 70), float("nan"), dtype=g.dtype)
    got = merge_rows(gin, packed, tcnt, width, nb, tile_n=tile_n if {spills} else None,
                     transpose=(wd, wdt) if {spills} else None)
    if {spills}:
        assert torch.equal(wdt, wd.t()), "transpose"
    if {spills}:
        # the rows read from g later are relu-exact: blocks with a tile over its slots, rows over the width
        bm = arch.launch_policy('cpu').merge_bm
        spilled_block = (tcnt > slots).any(1).view(-1, 1)
        blocks = torch.zeros(-(-m // bm) * bm, dtype=torch.bool)
        blocks[:m] = spilled_block[:, 0]
        need = blocks.view(-1, bm).any(1, keepdim=True).expand(-1, bm).reshape(-1)[:m] | (want.cnt > width)
        r_got = torch.relu(gin[need].float()).nan_to_num(nan=-7.0)
        r_want = torch.relu(g[need].float()).nan_to_num(nan=-7.0)
        assert torch.equal(r_got, r_want), (need.sum(), (r_got != r_want).sum())
    assert torch.equal(got.cnt, want.cnt), (got.cnt, want.cnt)
    listed = torch.arange(width)[None, :] < want.cnt.clamp(max=width)[:, None]
    assert torch.equal(got.lst[listed], want.lst[listed]), "lists"
    assert torch.equal(got.ctr, want.ctr), (got.ctr, want.ctr)
    for b in range(nb):
        c = int(want.ctr[b])
        assert torch.equal(got.order[b * m: b * m + c].sort().values, want.order[b * m: b * m + c].sort().values), b
    print("ok", int((tcnt > slots).sum()), int((want.cnt > width).sum()))
""")

MERGE_CASES = [
    # m, n, tile_n, slots, list width, buckets, dense rows
    (40, 300, 128, 64, 32, 2, 0),      # every tile within its slots; rows over the list width
    (40, 300, 128, 8, 64, 8, 0),       # tiles over 8 slots in many blocks: those list from g
    (37, 256, 64, 16, 256, 8, 3),      # dense rows in the first block only; lists wide enough
    (5, 96, 256, 4, 8, 1, 1),          # one tile narrower than tile_n, one bucket
    (24, 520, 32, 6, 48, 2, 0),        # 17 tiles of 6 slots (not a power of 2)
]


# the lists, counts and bucket order that merge_tiles_kernel makes from packed tiles equal
# compact_rows_kernel's from g (blocks with a tile over its slots list from g)
# (the tiles read in one step of CH slots, and in several of 32, 4 rows per program)
@pytest.mark.parametrize("launch", [dict(merge_bm=16), dict(merge_bm=4, compact_ch=32, compact_stages=2)])
@pytest.mark.parametrize("case", MERGE_CASES)
def test_merge_tiles_matches_compaction_under_interpreter(case, launch):
    run_interpreted(MERGE_SCRIPT.format(seed=sum(case), case=case, launch=launch, spills=False), timeout=60)


# with g written only where the packing spilled (gate_pack g="spills"; the rest poisoned), the
# same lists, and g rebuilt relu-exact for every row read from it later
@pytest.mark.parametrize("launch", [dict(merge_bm=16), dict(merge_bm=4, compact_ch=32, compact_stages=2)])
@pytest.mark.parametrize("case", MERGE_CASES)
def test_merge_tiles_rebuilds_g_where_the_gate_wrote_only_spills_under_interpreter(case, launch):
    run_interpreted(MERGE_SCRIPT.format(seed=sum(case) + 1, case=case, launch=launch, spills=True), timeout=60)
