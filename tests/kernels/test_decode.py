"""Decode path (kernels/cuda_decode.py, twell_decode.py): the kernels under TRITON_INTERPRET=1
on the CPU (tiny shapes, fp16: the interpreter's bf16 tl.dot is broken), the weight cache and
the policy on the CPU, and GPU tests (@pytest.mark.gpu): error grid with the 2x rule vs an fp32
reference, NaN/Inf, poisoned outputs, CUDA-graph capture and replay, in-place weight updates,
the op's dispatch by M, torch.compile with reduce-overhead."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import twell_compile.ops  # noqa: F401  (registers torch.ops.twell when this file runs alone)
from twell_compile import dispatch
from twell_compile.kernels import cuda_policy, weight_cache

# ----------------------------------------------------------------------------- interpreter
SCRIPT = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from twell_compile.kernels.cuda_decode import decode_forward, Config
    from twell_compile.reference import ffn_dense
    torch.manual_seed({seed})
    m, k, n, ko, gated, bias, density, bad, cfg, form = {case}
    dt = torch.float16
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
    bd = torch.randn(ko).to(dt) if bias else None
    if bad:
        x[1, 3] = float("nan"); x[0, 5] = float("inf")
    args = (x, wg, bg, wu, bu, wd, bd)
    from twell_compile.kernels import weight_cache
    if m % 2:    # odd M: through the registered W_down^T copy and persistent state
        assert weight_cache.register(wd)
    cfg = None if cfg is None else Config(*cfg)
    st = torch.full((4,), float("nan"), dtype=torch.float64)
    y, tok, hsum = decode_forward(*args, cfg=cfg, stats_buf=st, form=form)
    if m % 2:    # the persistent state is zero again, and a second call agrees
        assert not weight_cache.decode_state(wd, m)[0].any() and not weight_cache.decode_state(wd, m)[1].any()
        y2 = decode_forward(*args, cfg=cfg, form=form).y
        assert torch.allclose(y2.float(), y.float(), rtol=1e-2, atol=1e-2, equal_nan=True), "second call"
        if form == "list":     # no atomics: the same bits
            assert torch.equal(y2, y) or bad, "list form not repeatable"
    eager = ffn_dense(*args)
    assert torch.equal(torch.isnan(y), torch.isnan(eager)), "nan pattern"
    hg = torch.relu(F.linear(x, wg, bg))
    cnt = (hg != 0).sum(1).int()
    assert (tok[:m] - cnt).abs().sum() <= 2, (tok, cnt)
    assert int(tok[m]) == int(tok[:m].sum()), "total"
    assert st[0] == tok[m] and st[1] == tok[:m].max() and st[3] == 0, st
    assert abs(float(st[2]) - float(hsum)) <= 1e-3 * abs(float(hsum)) or (bad and not torch.isfinite(st[2]))
    fin = torch.isfinite(x).all(1)
    ref = ffn_dense(*(None if a is None else a[fin].double() if i == 0 else a.double()
                      for i, a in enumerate(args)))
    err = ((y[fin].double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    derr = ((eager[fin].double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err <= 2 * derr + 1e-6, (err, derr)
    if density == 0 and not bias:
        assert (y == 0).all()
    if not bad:
        h = hg * F.linear(x, wu, bu) if gated else hg
        assert abs(float(hsum) - float(h.double().abs().sum())) <= 1e-2 * float(h.double().abs().sum()) + 1e-3
    print("ok", err, derr)
""")

CASES = [
    # m, k, n, k_out, gated, bias, density, nan/inf rows, config (None: default): cuda_decode.Config
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


def test_rows_form_gemv_gate_only_at_one_row():
    from twell_compile.kernels import cuda_decode

    c = cuda_decode.config_for(1, 2048)
    assert c.gemv_bn and cuda_decode.rows_bn(1, c) == c.gemv_bn and cuda_decode.rows_bn(2, c) == c.bn
    for m, k, gemv, bn in ((1, 2048, True, c.gemv_bn), (2, 2048, False, c.bn), (1, 4096, False, c.bn)):
        p = cuda_decode.prepare(m, k, 5632, 2048, "rows", cuda_decode.config_for(m, k), True, False, False, False,
                                True, True)
        kern, grid, _, consts, _, _ = p.launch1
        assert consts["GEMV"] is gemv and consts["BN"] == bn and grid[0] == -(-5632 // bn), (m, k, consts)
        assert p.int_sizes[2] == 0 and p.float_sizes[1] == 0      # statistics go to the counters
    p = cuda_decode.prepare(1, 2048, 5632, 2048, "tiles", c, True, False, False, False, True, True)
    assert p.launch1[3]["GEMV"] is False and p.launch1[3]["BN"] == c.bn
    p = cuda_decode.prepare(3, 2048, 5632, 2048, "list", c, True, False, False, False, True, False)
    assert p.int_sizes[2] == -(-5632 // c.lbn) * 16      # the list form writes them per (block, row)


def test_list_and_pairs_launch_take_their_own_warps_and_blocks():
    from twell_compile.kernels import cuda_decode

    c = cuda_decode.config_for(16, 2048)
    assert c.pbn and c.ppb and c.pwarps and (c.pbn, c.ppb, c.pwarps) != (c.lbn, c.pb, c.warps)
    want = {"pairs": (c.pwarps, c.pbn, c.ppb), "list": (c.warps, c.lbn, c.pb)}
    for form, (warps_w, bn_w, pb_w) in want.items():
        kern, grid, _, consts, warps, stages = cuda_decode.prepare(16, 2048, 5632, 2048, form, c, True, False, False,
                                                                   False, True, True).launch1
        assert (warps, stages, consts["BN"], consts["PB"]) == (warps_w, c.lstages, bn_w, pb_w), form
        assert grid == (-(-5632 // bn_w), 1)
    warps = cuda_decode.prepare(16, 2048, 5632, 2048, "tiles", c, True, False, False, False, True, True).launch1[4]
    assert warps == c.warps
    wide = cuda_decode.config_for(16, 4096)           # K >= WIDE_K: the pairs form takes the list form's fields
    kern, grid, _, consts, warps, _ = cuda_decode.prepare(16, 4096, 11008, 4096, "pairs", wide, True, False, False,
                                                          False, True, True).launch1
    assert (warps, consts["BN"], consts["PB"]) == (wide.warps, wide.lbn, wide.pb)


def test_state_tail_holds_tickets_counters_and_sum():
    from twell_compile.kernels import weight_cache

    w = torch.nn.Parameter(torch.randn(6, 5))
    assert weight_cache.register(w)
    tk, cnt, hs = weight_cache.tail_parts(weight_cache.decode_state(w.detach(), 3)[1])
    assert (tk.numel(), cnt.numel(), hs.numel()) == (weight_cache.STATE_TICKETS, weight_cache.STATE_ROWS, 1)
    tail = torch.arange(weight_cache.tail_size(5), dtype=torch.int32)
    tk, cnt, hs = weight_cache.tail_parts(tail)
    assert tk.tolist() == list(range(weight_cache.STATE_TICKETS))
    assert cnt.numel() == 5 and int(cnt[0]) == weight_cache.STATE_TICKETS
    assert hs.dtype == torch.float32 and hs.numel() == 1
    assert hs.view(torch.int32).item() == weight_cache.STATE_TICKETS + 5


@pytest.mark.parametrize("case", CASES)
def test_decode_kernels_under_interpreter(case):
    pytest.importorskip("triton")
    import triton

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(seed=sum(case[:4]), case=case)],
                       env=env, capture_output=True, text=True, timeout=120)
    old = tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7)
    if r.returncode != 0 and old and "InterpreterError" in r.stderr:
        pytest.skip(f"Triton {triton.__version__} interpreter cannot run the kernels: {r.stderr[-200:]}")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert r.stdout.startswith("ok")


# ----------------------------------------------------------------------------- CPU: cache, policy
@pytest.fixture
def decode_wins_everywhere(monkeypatch):
    """Cost-model constants under which the decode path wins at density 0 for any shape: tests
    of the mechanism (the H200 constants pick decode only for large, sparse layers)."""
    for var in ("ROWS", "TILES", "LIST", "PAIRS"):
        monkeypatch.setattr(cuda_policy, f"DEC_{var}_FIXED_US", 0.0)
        monkeypatch.setattr(cuda_policy, f"DEC_{var}_GATE_GBPS", cuda_policy.DENSE_GBPS)
    for name in ("DEC_ROWS_STEP_US", "DEC_TILES_ENTRY_US", "DEC_TILES_ADD_US", "DEC_LIST_PAIR_US",
                 "DEC_LIST_ENTRY_US", "DEC_PAIRS_TRIP_US"):
        monkeypatch.setattr(cuda_policy, name, 0.0)
    monkeypatch.setattr(cuda_policy, "DENSE_FIXED_US", 1.0)


# a cost model under which decode wins while the union is small (mechanism tests)
_MECHANISM_CONSTANTS = (("DEC_ROWS_FIXED_US", 4.5), ("DEC_ROWS_GATE_GBPS", 3500.0), ("DEC_ROWS_STEP_US", 0.5),
                        ("DEC_TILES_FIXED_US", 5.0), ("DEC_TILES_GATE_GBPS", 3500.0), ("DEC_TILES_ENTRY_US", 0.01),
                        ("DEC_TILES_ADD_US", 0.01), ("DEC_LIST_FIXED_US", 6.0), ("DEC_LIST_GATE_GBPS", 3500.0),
                        ("DEC_LIST_PAIR_US", 1.0), ("DEC_LIST_ENTRY_US", 0.01),
                        ("DENSE_FIXED_US", 2.0), ("DENSE_GBPS", 3500.0))


def test_union_fraction():
    assert cuda_policy.union_fraction(0.005, 1) == pytest.approx(0.005)
    assert cuda_policy.union_fraction(0.2, 64) > 0.999
    assert cuda_policy.union_fraction(0.0, 64) == 0.0


def test_decode_cost_model_mechanism(monkeypatch):
    # constants of the first H200 run's policy: decode wins while the union is small
    for name, value in _MECHANISM_CONSTANTS:
        monkeypatch.setattr(cuda_policy, name, value)
    assert cuda_policy.decode_wins(0.005, 1, 2048, 5632, 2048, True)
    assert cuda_policy.decode_wins(0.005, 16, 2048, 5632, 2048, True)
    assert not cuda_policy.decode_wins(1.0, 64, 2048, 5632, 2048, True)
    assert not cuda_policy.decode_wins(0.2, 64, 4096, 11008, 4096, True)
    assert not cuda_policy.decode_wins(0.0, 1, 64, 256, 64, True)      # tiny layer: fixed costs


def test_shipped_decode_rule_reproduces_the_committed_h200_grid():
    """The committed H200 decode grid (bench_ffn.py --decode: every decode form forced, and the
    op with its policy, one run): the shipped rule, evaluated at each point's measured density,
    takes the path the op took there (except within 2% of the decision boundary, or between two
    forms predicted within 2% of each other: the op decides on its first layer's own measured
    density, the grid records the mean over its layers; at most 2 of each); the
    op never ran below 0.97x of dense; wherever a forced form was >= 1.25x faster than dense,
    the rule picks decode; and the form it picks is never more than 15% slower than the fastest
    form measured there."""
    import json
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200" / "ffn_decode.json"
    rows = json.loads(path.read_text())
    assert len(rows) == 56
    picked = near = tied = 0
    for r in rows:
        d = r["nnz_per_row"] / r["N"]
        wins = cuda_policy.decode_wins(d, r["M"], r["K"], r["N"], r["K"], True)
        form = cuda_policy.decode_form(d, r["M"], r["K"], r["N"], r["K"])
        want = f"decode-{form}" if wins else "dense"
        t_dense = cuda_policy.DENSE_FIXED_US + 2e-3 * r["N"] * 3 * r["K"] / cuda_policy.DENSE_GBPS
        edge = cuda_policy.DEC_MARGIN * t_dense
        ts = sorted(cuda_policy.decode_us(d, r["M"], r["K"], r["N"], r["K"]).values())
        t_dec = ts[0]
        if abs(t_dec / edge - 1) <= 0.02:
            near += 1
        elif wins and ts[1] <= 1.02 * ts[0]:     # two forms predicted within 2%: either one
            tied += r["path"] != want
            assert r["path"].startswith("decode-"), (r["M"], r["K"], r["density"], r["path"], want)
        else:
            assert r["path"] == want, (r["M"], r["K"], r["density"], r["path"], want)
        assert r["dense_ms"] / r["twell_ms"] >= 0.97, r
        if r["dense_ms"] / r["kernel_ms"] >= 1.25:
            assert wins, r
        if wins:
            assert r["form_ms"][form] <= 1.15 * min(r["form_ms"].values()), (r, form)
        picked += wins
    # 15 of 56 points decode on the 2026-11-25 grid (W_down^T read strided; 20+ with the old
    # stale-prone copy): a drop below 12 means the rule lost wins
    assert picked >= 12 and near <= 2 and tied <= 2


def test_decode_form_rule():
    """Rows (one active neuron at a time) for few rows with few active neurons per program, the
    pairs form for more rows at low density, tiles where many neurons are active: whichever
    the fitted cost model predicts fastest."""
    from twell_compile.kernels import cuda_decode
    vec_m = cuda_decode.CONFIGS[16].vec_m
    assert vec_m >= 1
    assert cuda_policy.decode_form(0.005, 1, 2048, 5632, 2048) == "rows"
    assert cuda_policy.decode_form(0.005, 16, 2048, 5632, 2048) == "pairs"
    assert cuda_policy.decode_form(0.005, 16, 4096, 11008, 4096) == "pairs"
    assert cuda_policy.decode_form(0.2, 4, 2048, 5632, 2048) == "tiles"
    assert "rows" not in cuda_policy.decode_us(0.0, vec_m + 1, 2048, 5632, 2048)    # no rows form
    t = cuda_policy.decode_us(0.05, 1, 2048, 5632, 2048)
    assert set(t) == {"rows", "tiles", "list", "pairs"} and min(t.values()) > 0
    lo = cuda_policy.decode_us(0.005, 1, 2048, 5632, 2048)
    assert all(t[f] > lo[f] for f in ("rows", "list", "pairs"))


def test_deterministic_mode_takes_the_form_without_atomics(monkeypatch):
    """torch.use_deterministic_algorithms(True): the decode rule only considers the list form
    (fixed summation order), and still falls back to dense where that form cannot win."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)   # CPU builds
    cuda_policy.reset()
    key = ("det", "cuda", torch.bfloat16, 2048, 5632, 2048, True)
    assert cuda_policy.use_decode(key, 16, 2048, 5632, 2048, True) == "pairs"
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        # the list form reads W_down^T rows strided (no copy): at K=2048 it never beat dense on
        # the H200 grid (M=1 d=0.005: 46.6 vs 34.0 us), so deterministic decode runs dense
        assert cuda_policy.use_decode(key, 16, 2048, 5632, 2048, True) is None
        assert cuda_policy.DETERMINISTIC_FORMS == ("list",)
        assert cuda_policy.decode_form(0.0, 16, 2048, 5632, 2048, ("list",)) == "list"
        assert not cuda_policy.decode_wins(0.2, 16, 2048, 5632, 2048, True, ("list",))
    finally:
        torch.use_deterministic_algorithms(was)
    assert cuda_policy.use_decode(key, 16, 2048, 5632, 2048, True) == "pairs"
    cuda_policy.reset()


def test_decode_forward_rejects_bad_forms():
    from twell_compile.kernels.cuda_decode import decode_forward
    x = torch.zeros(8, 16)
    w = torch.zeros(32, 16)
    with pytest.raises(ValueError, match="form"):
        decode_forward(x, w, None, w, None, w.t().contiguous(), None, form="lists")
    with pytest.raises(ValueError, match="vec_m"):
        decode_forward(x, w, None, w, None, w.t().contiguous(), None, form="rows")


def test_static_dense_reason_for_decode_sizes(decode_wins_everywhere, monkeypatch):
    cuda = torch.device("cuda")
    cp = cuda_policy
    for m in (1, 16, cp.DECODE_MAX_M, None):
        assert dispatch.static_dense_reason(cuda, torch.bfloat16, m, 2048, 5632, 2048) is None
    mid = dispatch.static_dense_reason(cuda, torch.bfloat16, cp.DECODE_MAX_M + 1, 2048, 5632, 2048)
    assert mid and f"{cp.DECODE_MAX_M + 1} tokens" in mid and "decode" in mid
    # the decode path takes any width; the per-row path does not
    assert dispatch.static_dense_reason(cuda, torch.float16, 1, cp.MAX_WIDTH + 1, 64, 64) is None
    assert "wide" in dispatch.static_dense_reason(cuda, torch.float16, cp.MIN_TOKENS, cp.MAX_WIDTH + 1, 64, 64)
    assert "float32" in dispatch.static_dense_reason(cuda, torch.float32, 1, 2048, 5632, 2048)
    # where decode cannot win even at density 0 (here: fixed costs far above dense's), a static
    # decode-sized FFN stays with Inductor; a dynamic one is rewritten and decided per call
    for var in ("ROWS", "TILES", "LIST", "PAIRS"):
        monkeypatch.setattr(cp, f"DEC_{var}_FIXED_US", 1e3)
    why = dispatch.static_dense_reason(cuda, torch.bfloat16, 1, 256, 1024, 256)
    assert why and "1 tokens" in why and "decode" in why
    assert dispatch.static_dense_reason(cuda, torch.bfloat16, None, 256, 1024, 256) is None
    # with the shipped (H200) constants the measured shape is rewritten
    monkeypatch.undo()
    assert dispatch.static_dense_reason(cuda, torch.bfloat16, 1, 2048, 5632, 2048) is None


def test_backend_registers_w_down_of_rewritten_ffns(monkeypatch, decode_wins_everywhere):
    """The compile-time hook finds the real W_down parameter behind each rewritten FFN whose
    decode path can win (and none where the cost model says it cannot)."""
    from twell_compile import backend

    seen = []
    monkeypatch.setattr(weight_cache, "register", lambda w, base=None: seen.append((w, base)) or True)
    monkeypatch.setattr(weight_cache, "wanted", lambda w: w.dim() == 2)   # CPU fp32 here

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(16, 40, bias=False), nn.Linear(16, 40, bias=False)
            self.down_proj = nn.Linear(40, 16, bias=False)

        def forward(self, x):
            return self.down_proj(F.relu(self.gate_proj(x)) * self.up_proj(x))

    from twell_compile.passes import run_passes
    from twell_compile.config import TwellConfig

    model = MLP()
    x = torch.randn(4, 16)
    captured = {}

    def grab(gm, example_inputs):
        captured["gm"], captured["inputs"] = run_passes(gm, TwellConfig()), example_inputs
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=grab)(x)
    backend.reserve_decode_state(captured["gm"], captured["inputs"])
    assert len(seen) == 1
    w, base = seen[0]
    assert base is model.down_proj.weight and w.data_ptr() == base.data_ptr()
    for var in ("ROWS", "TILES", "LIST", "PAIRS"):                 # decode can never win
        monkeypatch.setattr(cuda_policy, f"DEC_{var}_FIXED_US", 1e6)
    seen.clear()
    backend.reserve_decode_state(captured["gm"], captured["inputs"])
    assert not seen


# ----------------------------------------------------------------------------- GPU
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

gpu = pytest.mark.gpu
DT = [torch.bfloat16, torch.float16]


def _ffn(m, k, n, k_out, density, dtype, gated=True, bias=True, tail=0.0, seed=None):
    from synthetic import make_ffn
    seed = torch.randint(0, 2**31, ()).item() if seed is None else seed
    p = make_ffn(m, k, n, max(density, 1e-9), tail, gated=gated, dtype=torch.float32, seed=seed)
    g = torch.Generator("cuda").manual_seed(seed + 1)
    p["w_down"] = torch.randn(k_out, n, generator=g, device="cuda") / (n * max(density, 1e-3)) ** 0.5
    if density == 0.0:
        p["w_gate"][:, 0] = -1e4
    if bias:
        p["b_gate"] = torch.randn(n, generator=g, device="cuda") * 0.1
        p["b_up"] = torch.randn(n, generator=g, device="cuda") if gated else None
        p["b_down"] = torch.randn(k_out, generator=g, device="cuda")
    return {key: None if v is None else v.to(dtype) for key, v in p.items()}


def _args(p):
    return p["x"], p["w_gate"], p["b_gate"], p["w_up"], p["b_up"], p["w_down"], p["b_down"]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _poison():
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk


def _check(p, cfg=None, form=None):
    from twell_compile.kernels.cuda_decode import Config, decode_forward
    from twell_compile.reference import ffn_dense
    args = _args(p)
    _poison()
    y, tok, hsum = decode_forward(*args, cfg=None if cfg is None else Config(*cfg), form=form)
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
    from twell_compile.kernels.cuda_decode import decode_forward
    p = _ffn(m, 512, 1408, 520, density, dtype, tail=tail)
    registered = form == "pairs" and m % 2 == 1        # the persistent accumulator
    if registered:
        assert weight_cache.register(p["w_down"])
    y = _check(p, form=form)
    if form == "list":
        assert torch.equal(y, decode_forward(*_args(p), form="list").y), "list form not deterministic"
    else:
        _check(p, form=form)                           # a second call: the state was zeroed
    if registered:
        acc, tk = weight_cache.decode_state(p["w_down"], m)
        assert not acc.any(), "persistent accumulator not zero after the call"
    weight_cache.clear()


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
        weight_cache.register(p["w_down"])
    for _ in range(2):
        _check(p, cfg)
        if registered:
            acc, tk = weight_cache.decode_state(p["w_down"], m)
            assert not acc.any() and not tk.any(), "persistent state not zero after the call"
    weight_cache.clear()


@gpu
def test_decode_writes_the_layer_statistics_buffer():
    from twell_compile.kernels.cuda_decode import decode_forward
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
@pytest.mark.parametrize("form", [None, "list", "pairs"])
def test_decode_nan_inf_propagate_like_eager(gated, bad, form):
    from twell_compile.kernels.cuda_decode import decode_forward
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
    from twell_compile.kernels.cuda_decode import decode_forward
    for _ in range(3):
        p = _ffn(16, 1024, 2816, 1024, 0.01, torch.bfloat16)
        a = decode_forward(*_args(p)).y
        b = decode_forward(*_args(p)).y
        assert _rel(a, b) < 4e-3            # at most last-bit flips of bf16 outputs
        _check(p)


@gpu
@pytest.mark.parametrize("m,registered,form", [(4, True, None), (1, True, None), (4, False, None), (40, True, None),
                                               (16, True, "list"), (40, False, "list"),
                                               (16, True, "pairs"), (40, False, "pairs"), (3, True, "pairs")])
def test_decode_cuda_graph_capture_and_replay_with_new_inputs(m, registered, form):
    """Replays with fresh inputs, interleaved with eager calls on the same weights: every result
    within the error rule (the persistent accumulator stays zero between calls)."""
    from twell_compile.kernels.cuda_decode import decode_forward
    from twell_compile.reference import ffn_dense
    weight_cache.clear()
    p = _ffn(m, 1024, 2816, 1024, 0.01, torch.bfloat16)
    if registered:
        assert weight_cache.register(p["w_down"])
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
        acc, tk = weight_cache.decode_state(p["w_down"], m)
        assert not acc.any() and not tk.any()
    weight_cache.clear()


@gpu
def test_weight_updates_are_seen_by_calls_and_graph_replays():
    from twell_compile.kernels.cuda_decode import decode_forward
    from twell_compile.reference import ffn_dense
    weight_cache.clear()
    p = _ffn(2, 512, 1408, 512, 0.01, torch.bfloat16)
    wd = nn.Parameter(p["w_down"], requires_grad=False)
    p["w_down"] = wd
    assert weight_cache.register(wd)
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
    weight_cache.clear()


@gpu
def test_op_dispatch_by_m_and_density(monkeypatch):
    """M <= DECODE_MAX_M runs the decode kernels where the rule says so (before any
    measurement: at density 0); the lagged density then switches a busy layer at M = 64 to
    dense; M between the paths runs dense. Constants of the first H200 run's policy (under
    the shipped ones every point here runs dense)."""
    from twell_compile.kernels import cuda_decode
    from twell_compile.reference import ffn_dense
    cuda_policy.reset()
    for name, value in _MECHANISM_CONSTANTS:
        monkeypatch.setattr(cuda_policy, name, value)
    calls = []
    real = cuda_decode.decode_forward
    monkeypatch.setattr(cuda_decode, "decode_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for m, density, want in ((1, 0.005, [True, True]), (64, 0.5, [True, False]), (300, 0.005, [False, False])):
        p = _ffn(m, 2048, 5632, 2048, density, torch.bfloat16)
        for want_decode in want:
            calls.clear()
            y = torch.ops.twell.ffn(*_args(p), 128, 16, f"disp{m}", True)
            torch.cuda.synchronize()
            assert bool(calls) == want_decode, (m, density)
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
    cuda_policy.reset()
    p = _ffn(16, 2048, 5632, 2048, 0.005, torch.bfloat16)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        ys = [torch.ops.twell.ffn(*_args(p), 128, 16, "det16", False) for _ in range(4)]
    finally:
        torch.use_deterministic_algorithms(was)
    assert all(torch.equal(ys[0], y) for y in ys[1:])
    ref = ffn_dense(*(None if a is None else a.float() for a in _args(p)))
    assert _rel(ys[0], ref) <= 2 * _rel(ffn_dense(*_args(p)), ref) + 1e-6
    cuda_policy.reset()


class _MLP(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        from synthetic import make_ffn
        self.gate_proj = nn.Linear(k, n, bias=False)
        self.up_proj = nn.Linear(k, n, bias=False)
        self.down_proj = nn.Linear(n, k, bias=False)
        p = make_ffn(8, k, n, 0.01, 0.0, dtype=torch.float32)
        with torch.no_grad():
            self.gate_proj.weight.copy_(p["w_gate"])
            self.up_proj.weight.copy_(p["w_up"])
            self.down_proj.weight.copy_(p["w_down"])

    def forward(self, x):
        return self.down_proj(F.relu(self.gate_proj(x)) * self.up_proj(x))


@gpu
def test_compile_reduce_overhead_decode(monkeypatch, decode_wins_everywhere):
    from torch._dynamo.utils import counters
    from twell_compile.kernels import cuda_decode
    cuda_policy.reset()
    weight_cache.clear()
    calls = []
    real = cuda_decode.decode_forward
    monkeypatch.setattr(cuda_decode, "decode_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    counters.clear()
    model = _MLP(512, 1408).cuda().to(torch.bfloat16)
    f = torch.compile(model, backend="twell", mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
            x[:, 0] = 1.0
            y = f(x).clone()
            torch.cuda.synchronize()
        ref = model.float()(x.float())
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert calls, "the decode kernels were not used"
    # the decode state, made at compile time (no weight copy)
    assert weight_cache.state_bytes() == (weight_cache.STATE_ROWS * 512 + weight_cache.STATE_TAIL) * 4
    assert _rel(y, ref) < 2e-2
    weight_cache.clear()


@gpu
def test_static_decode_ffn_is_rewritten_only_with_cuda_graphs(decode_wins_everywhere):
    """Default mode (no CUDA graphs): a static 1-token FFN stays with Inductor, with the reason;
    reduce-overhead, or twell.cudagraphs='on' for graphs captured by hand: rewritten."""
    import twell_compile

    model = _MLP(512, 1408).cuda().to(torch.bfloat16)
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        plain = twell_compile.explain(model, x)
        assert not plain.rewrites and "without CUDA graphs" in str(plain)
        for options in ({"twell.mode": "reduce-overhead"}, {"twell.cudagraphs": "on"}):
            torch._dynamo.reset()
            assert len(twell_compile.explain(model, x, options=options).rewrites) == 1, options
