"""The kernel choice (runtime/select.py): the compile-time twin (static_reason) and the per-call
plans on the CPU. The CUDA rules are host arithmetic on the device's record: here they read
the H200 record (arch.cuda_default without a GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from twell_compile.runtime import arch, select

CUDA = torch.device("cuda")
CPU = torch.device("cpu")
P = arch.cuda_default()


def reason(device, dtype, m, k=2048, n=5632, k_out=2048, **kw):
    return select.static_reason(device, dtype, m, k, n, k_out, **kw)


def tokens(hint: int, per: int = 1):
    """A backed SymInt token count (hint x per) on a fresh shape environment."""
    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(hint, source=ConstantSource("m")), hint=hint)
    return env, s * per if per != 1 else s


def guards(env) -> list[str]:
    return sorted(str(g.expr) for g in env.guards)


# --------------------------------------------------------------------------- CUDA inference
def test_cuda_fp32_is_dense():
    why = reason(CUDA, torch.float32, 65536)
    assert why and "float32" in why


def test_cuda_static_tokens_between_the_sparse_paths_are_dense_but_dynamic_tokens_are_not():
    for graphs, rows_min in ((False, P.min_tokens), (True, P.graphs_min_tokens or P.min_tokens)):
        for few in (P.decode_max_m + 1, rows_min - 1):
            assert f"{few} tokens" in reason(CUDA, torch.bfloat16, few, cudagraphs=graphs)
        for m in (rows_min, None):   # per-row, unknown (decode sizes: runtime/test_cuda_decode.py)
            assert reason(CUDA, torch.bfloat16, m, cudagraphs=graphs) is None


@pytest.mark.parametrize("record", [arch.H200, arch.H100])
def test_inside_cuda_graphs_the_per_row_path_takes_the_records_bound_for_graphs(record):
    """Host time does not count inside CUDA graphs: a record's graphs_min_tokens (2048 on the
    H200 and the H100) opens the per-row path there under its min_tokens (4096 on both); 0 in
    the record: the same bound both ways."""
    with arch.patched(**{f: getattr(record, f) for f in ("min_tokens", "graphs_min_tokens")}):
        lo = record.graphs_min_tokens or record.min_tokens
        assert reason(CUDA, torch.bfloat16, lo, cudagraphs=True) is None
        if lo == record.min_tokens:
            assert reason(CUDA, torch.bfloat16, lo, cudagraphs=False) is None
        with arch.patched(min_tokens=4096, graphs_min_tokens=2048):
            assert reason(CUDA, torch.bfloat16, 2048, cudagraphs=True) is None
            assert "below the per-row path's 4096" in reason(CUDA, torch.bfloat16, 2048, cudagraphs=False)
            with arch.patched(graphs_min_tokens=0):
                assert "below the per-row path's 4096" in reason(CUDA, torch.bfloat16, 2048, cudagraphs=True)
            # a dynamic count is guarded to the range its hint falls in, by the same bound
            env, m = tokens(3000)
            assert reason(CUDA, torch.bfloat16, m, cudagraphs=True) is None
            assert guards(env)
            env, m = tokens(3000)
            assert "below the per-row path's 4096" in reason(CUDA, torch.bfloat16, m, cudagraphs=False)


def test_cuda_grouped_experts_stay_dense_unless_forced_or_penalised():
    """Experts run one single-FFN call each after a host read of the routing: Inductor's
    grouped_mm wins on CUDA (results/h200/moe.json), so the compile-time rule leaves them; one
    FFN of the same size is rewritten, and the CPU, a forced path and an L1 penalty rewrite."""
    why = reason(CUDA, torch.bfloat16, P.min_tokens, experts=8)
    assert why and "8 grouped experts" in why and "moe.json" in why
    assert reason(CUDA, torch.bfloat16, P.min_tokens) is None
    assert reason(CUDA, torch.bfloat16, 65536, training=True, experts=8)
    assert reason(CUDA, torch.bfloat16, 65536, training=True, l1=1e-3, experts=8) is None
    assert reason(CUDA, torch.bfloat16, P.min_tokens, path="twell", experts=8) is None
    assert reason(CPU, torch.float32, 4096, experts=8) == reason(CPU, torch.float32, 4096)
    # the rule alone, as prepared experts modules ask it: no shape read
    assert select.experts_reason(CUDA, 8) == why
    assert select.experts_reason(CUDA, 8, training=True, l1=1e-3) is None
    assert select.experts_reason(CUDA, 8, path="twell") is None
    assert select.experts_reason(CPU, 8) is None and select.experts_reason(CUDA, 0) is None


def test_cuda_width_limits_apply_at_prefill_sizes_only():
    big = P.min_tokens
    narrow = reason(CUDA, torch.bfloat16, big, 512, 1408, 512)
    assert narrow and "K=512" in narrow                    # a K=512 model ran 0.71x on the per-row path
    assert reason(CUDA, torch.bfloat16, None, 512, 1408, 512) is None
    assert reason(CUDA, torch.bfloat16, 1, 512, 1408, 512) is None   # decode: 1.5x+
    assert "wide" in reason(CUDA, torch.float16, big, select.MAX_WIDTH + 1, 64, 64)
    assert "wide" in reason(CUDA, torch.float16, big, 64, select.MAX_N + 1, 64)
    # a dynamic M may be decode-sized: the decode path takes any width
    assert reason(CUDA, torch.float16, None, 64, select.MAX_N + 1, 64) is None


def test_cuda_decode_sizes_need_cuda_graphs():
    """Without CUDA graphs the decode step is host-bound and the rewrite lost end to end (H200,
    0.63x at batch 1): static decode-sized FFNs then stay with Inductor; unknown M does not."""
    why = reason(CUDA, torch.bfloat16, 1, cudagraphs=False)
    assert why and "without CUDA graphs" in why and "twell.cudagraphs" in why
    assert reason(CUDA, torch.bfloat16, 1, cudagraphs=True) is None
    assert reason(CUDA, torch.bfloat16, None, cudagraphs=False) is None
    assert reason(CUDA, torch.bfloat16, P.min_tokens, cudagraphs=False) is None


def test_a_forced_path_always_rewrites():
    for path in ("dense", "twell", "decode"):
        assert reason(CUDA, torch.float32, 1000, path=path) is None
        assert reason(CPU, torch.float16, 1, 16, 40, 16, path=path) is None


def test_inference_dynamic_token_counts_are_guarded_to_their_range():
    """A SymInt count is answered as its hint is, and the range the hint is in (decode-sized,
    the band, per-row sized) joins the shape environment's guards; facts that decide without
    the count add no guard; unbacked counts keep the rewrite."""
    lo, hi = P.decode_max_m, P.min_tokens       # without CUDA graphs (with: the bound for graphs)
    env, m = tokens(1024)
    why = reason(CUDA, torch.bfloat16, m, cudagraphs=False)
    assert why and "1024 now" in why and f"guarded to {lo + 1}-{hi - 1} tokens" in why and "decode path" in why
    assert guards(env) == sorted([f"{m.node.expr} < {hi}", f"{m.node.expr} >= {lo + 1}"])
    for cudagraphs in (False, True):       # decode-sized: the CUDA-graph rule as for a static count
        env, m = tokens(2)
        why = reason(CUDA, torch.bfloat16, m, cudagraphs=cudagraphs)
        assert (why is None) == cudagraphs and (cudagraphs or f"guarded to <= {lo}" in why)
        assert guards(env) == [f"{m.node.expr} < {lo + 1}"]
    env, m = tokens(hi)
    assert reason(CUDA, torch.bfloat16, m, cudagraphs=False) is None
    assert guards(env) == sorted([f"{m.node.expr} >= {lo + 1}", f"{m.node.expr} >= {hi}"])
    env, m = tokens(hi)                    # per-row sized: the width rules apply
    assert "wide" in reason(CUDA, torch.bfloat16, m, 64, select.MAX_N + 1, 64, cudagraphs=False)
    env, m = tokens(1024)                  # decided without the count: no guard
    assert "float32" in reason(CUDA, torch.float32, m)
    assert "float16" in reason(CPU, torch.float16, m)
    assert not env.guards
    env = ShapeEnv()
    assert reason(CUDA, torch.bfloat16, env.create_unbacked_symint()) is None
    assert not env.guards


def test_a_user_range_spanning_two_ranges_is_never_narrowed():
    env = ShapeEnv()
    s = env.create_symbol(100, source=ConstantSource("m"))
    env.constrain_symbol_range(s, compiler_min=1, compiler_max=20000)
    m = env.create_symintnode(s, hint=100)
    assert reason(CUDA, torch.bfloat16, m) is None and not env.guards


# --------------------------------------------------------------------------- training
def test_training_reasons_for_slow_paths():
    assert "float32" in reason(CUDA, torch.float32, 65536, training=True)
    few = P.train_min_tokens - 1
    assert f"{few} tokens" in reason(CUDA, torch.bfloat16, few, training=True)
    assert "wide" in reason(CUDA, torch.float16, None, select.MAX_WIDTH + 1, 64, 64, training=True)
    for m in (P.train_min_tokens, None):   # the sparse branch is reachable: keep the rewrite
        assert reason(CUDA, torch.bfloat16, m, training=True) is None
    narrow = P.train_min_width // 2        # the sparse branch is not: Inductor's FFN ...
    assert f"K={narrow}" in reason(CUDA, torch.bfloat16, 65536, narrow, 4 * narrow, narrow, training=True)
    assert reason(CUDA, torch.bfloat16, 65536, narrow, 4 * narrow, narrow, training=True, l1=1.0) is None  # ... unless L1


def test_training_on_cpu_is_left_to_inductor_unless_the_penalty_needs_our_backward():
    why = reason(CPU, torch.float32, 64, 16, 40, 16, training=True)
    assert why and "plain-PyTorch" in why and "twell.l1" in why
    assert reason(CPU, torch.float32, 64, 16, 40, 16, training=True, l1=1.0) is None
    assert reason(CUDA, torch.float32, 64, training=True, l1=1.0) is None


def test_training_dynamic_token_counts_are_answered_under_a_guard():
    """A SymInt token count is answered as its hint would be, and the answer joins the shape
    environment's guards (m < train_min_tokens or its negation); unbacked counts keep the rewrite."""
    env, m = tokens(256, per=4)            # [b, 4, K]: 4b tokens
    why = reason(CUDA, torch.bfloat16, m, training=True)
    assert why and "1024 now" in why and "recompiles once" in why
    assert guards(env) == [f"{m.node.expr} < {P.train_min_tokens}"]
    env, m = tokens(P.train_min_tokens // 4, per=4)
    assert reason(CUDA, torch.bfloat16, m, training=True) is None
    assert guards(env) == [f"{m.node.expr} >= {P.train_min_tokens}"]
    env, m = tokens(256, per=4)            # facts that decide without the count add no guard
    assert "float32" in reason(CUDA, torch.float32, m, training=True)
    assert "CPU" in reason(CPU, torch.bfloat16, m, training=True)
    assert not env.guards
    env = ShapeEnv()
    assert reason(CUDA, torch.bfloat16, env.create_unbacked_symint() * 4, training=True) is None
    assert not env.guards


# --------------------------------------------------------------------------- CPU inference
def test_cpu_inference_under_the_kernels_tokens_or_width_is_left_to_inductor():
    p = arch.CPU
    why = reason(CPU, torch.float32, p.min_tokens - 1, 1024, 2816, 1024)
    assert why and f"{p.min_tokens - 1} tokens" in why and "CPU kernel" in why
    why = reason(CPU, torch.float32, 4096, p.min_width - 1, 384, 96)
    assert why and f"K={p.min_width - 1}" in why
    assert reason(CPU, torch.float32, None, 1024, 2816, 1024) is None          # unknown count: the op decides
    assert "float16" in reason(CPU, torch.float16, 10 ** 6, 1024, 2816, 1024)


def test_cpu_inference_dynamic_counts_are_guarded():
    with arch.patched(min_tokens=64):      # a record with a token threshold
        env, m = tokens(8)
        why = reason(CPU, torch.float32, m, 1024, 2816, 1024)
        assert why and "8 now" in why and "< 64" in why
        assert guards(env) == [f"{m.node.expr} < 64"]
    env, m = tokens(8)                     # decided by the width: no guard
    assert "K=16" in reason(CPU, torch.float32, m, 16, 40, 16) and not env.guards
    if arch.CPU.min_tokens <= 2:           # the record's own rule: every count of a wide layer, no guard
        env, m = tokens(8)
        reason(CPU, torch.float32, m, 1024, 2816, 1024)
        assert not env.guards


@pytest.mark.slow
def test_cpu_inference_at_the_kernels_sizes_is_rewritten():
    """Builds the C++ kernel (once per checkout and version)."""
    assert reason(CPU, torch.float32, 4096, 2048, 5632, 2048) is None
    assert reason(CPU, torch.bfloat16, arch.CPU.min_tokens, 2048, 5632, 2048) is None


# --------------------------------------------------------------------------- per-call plans
def test_cpu_plans_by_size_and_forced_paths():
    small = torch.randn(2, 16)
    assert select.plan_infer(small, 40, 16, True, "l").path == "torch"
    assert select.plan_infer(small, 40, 16, True, "l", path="torch").path == "torch"
    for path in ("dense", "twell", "decode", "decode-rows", "decode-union", "decode-union2"):
        with pytest.raises(ValueError, match="CUDA path"):
            select.plan_infer(small, 40, 16, True, "l", path=path)
    with pytest.raises(ValueError, match="path must be one of"):
        select.plan_infer(small, 40, 16, True, "l", path="fast")
    with pytest.raises(ValueError, match="float16"):
        select.plan_infer(small.half(), 40, 16, True, "l", path="cpu")


def test_training_plans_on_cpu_run_plain_pytorch_and_refuse_forced_cuda_paths():
    x = torch.randn(64, 16)
    assert select.plan_train(x, 40, 16, True, 8, 16, "l").path == "torch"
    with pytest.raises(ValueError, match="plain PyTorch"):
        select.plan_train(x, 40, 16, True, 8, 16, "l", path="twell")
    with pytest.raises(ValueError, match="path must be one of"):
        select.plan_train(x, 40, 16, True, 8, 16, "l", path="decode")


# --------------------------------------------------------------------------- cost models
@pytest.mark.parametrize("k,n,limit", [(2048, 5632, 0.0114), (4096, 11008, 0.0072)])
def test_break_even_density_follows_the_weights_l2_residency(k, n, limit):
    """W_u + W_d in L2 (46 MB at K=2048) gather faster per pair than from HBM (180 MB)."""
    assert select.twell_wins(arch.H200, 0.99 * limit, True, k, n, k, 2)
    assert not select.twell_wins(arch.H200, 1.01 * limit, True, k, n, k, 2)


@pytest.mark.parametrize("policy, gated, graphed_up_to", [
    (arch.H200, True, 4096), (arch.H200, False, 8192), (arch.H100, True, 4096), (arch.H100, False, 8192)])
def test_per_row_calls_are_graphed_while_their_gpu_time_is_under_the_eager_host_time(policy, gated, graphed_up_to):
    """rows_host_bound at d=0.005, K=2048, N=5632: the measured crossovers (H200: non-gated
    8192 tokens graphed 1.20x against eager 0.74-1.11x, gated 8192 eager 1.38x against graphed
    1.35x; H100: non-gated 8192 eager host-bound, 486 us of host time against 460 of GPU time);
    the modeled time grows with tokens and density; the fallback record never graphs."""
    for m in (1024, 2048, 4096, 8192, 16384, 65536):
        got = select.rows_host_bound(policy, 0.005, m, 2048, 5632, 2048, gated)
        assert got == (m <= graphed_up_to), (policy.name, gated, m)
    t = [select.rows_us(policy, d, 4096, 2048, 5632, 2048, gated) for d in (0.0, 0.005, 0.02)]
    assert t[0] < t[1] < t[2]
    assert select.rows_us(policy, 0.005, 8192, 2048, 5632, 2048, gated) == pytest.approx(
        2 * select.rows_us(policy, 0.005, 4096, 2048, 5632, 2048, gated))
    assert not select.rows_host_bound(arch.FALLBACK, 0.0, 1, 2048, 5632, 2048, gated)


def test_heavy_rows_split_only_where_the_measured_peak_row_is_skewed():
    """Rule 5 on the H200 record (2 parts over 64 non-zeros, peak over 3x the mean, up to 2048
    tokens): the activity profile's layer (34 non-zeros per row, up to 169) splits; i.i.d. rows
    at the same density (peak ~50) do not, nor denser i.i.d. rows (mean 62, peak 95: under the
    skew), nor a layer with no measurement or no peak, nor 4096 tokens, nor a record without
    the split (the H100's)."""
    p, n = arch.H200, 5632
    assert p.row_split == 2 and p.row_split_max_m == 2048
    assert select.splits_rows(p, 2048, 34 / n, 169.0, n)
    assert select.splits_rows(p, 1000, 34 / n, 169.0, n)
    assert not select.splits_rows(p, 2048, 28 / n, 50.0, n)
    assert not select.splits_rows(p, 2048, 62 / n, 95.0, n)
    assert not select.splits_rows(p, 4096, 34 / n, 169.0, n)
    assert not select.splits_rows(p, 2048, None, None, n)
    assert not select.splits_rows(p, 2048, 34 / n, None, n)
    assert not select.splits_rows(arch.H100, 2048, 34 / n, 169.0, n)
    # the bounds are the record's: a peak at the pairs bound, or at the skew bound, stays whole
    assert not select.splits_rows(p, 2048, 10 / n, 64.0, n)
    assert not select.splits_rows(p, 2048, 30 / n, 90.0, n)
    assert select.splits_rows(p, 2048, 30 / n, 91.0, n)
    with arch.patched(row_split_max_m=0, row_split_skew=0.0):
        q = arch.cuda_default()
        assert select.splits_rows(q, 65536, 62 / n, 95.0, n)      # any size, any skew


@pytest.mark.parametrize("gated, graphed_up_to", [(True, 2048), (False, 2048)])
def test_dense_calls_past_decode_sizes_are_graphed_while_their_gemms_are_under_the_eager_host_time(
        gated, graphed_up_to):
    """op_dense_prefill_host_us on the H200 record (250 us; the module's eager dense call at
    2048 tokens took 499 us of host time against ~204 of GPU time, and at 4096 the graph gained
    nothing) at K=2048 N=5632: the GEMMs' modeled time grows with the tokens; the H100's record
    graphs none."""
    p = arch.H200
    for m in (128, 2048, 4096, 8192, 16384):
        got = select.dense_gemms_us(p, m, 2048, 5632, 2048, gated) < p.op_dense_prefill_host_us
        assert got == (m <= graphed_up_to), (gated, m)
    assert select.dense_gemms_us(p, 2048, 2048, 5632, 2048, True) == pytest.approx(
        1.5 * select.dense_gemms_us(p, 2048, 2048, 5632, 2048, False))
    assert not select.dense_gemms_us(arch.H100, 128, 2048, 5632, 2048, gated) < arch.H100.op_dense_prefill_host_us


def test_list_width_grows_with_the_measured_density_within_bounds():
    p = arch.H200
    assert select.list_width(p, 5632) == p.list_min
    assert select.list_width(p, 5632, 28.0) == 256          # pow2(4 x 28 + 32) = 256
    assert select.list_width(p, 5632, 5000.0) == p.list_max
    assert select.list_width(p, 16, 28.0) == 16               # never wider than pow2(N)


@pytest.mark.parametrize("device, dtype, m, k, training, path, want", [
    (CPU, torch.float32, 7, 16, True, "auto", "plain PyTorch (exact"),
    (CPU, torch.float32, 4096, 1024, False, "auto", "C++ CPU kernel"),
    (CPU, torch.float32, 1, 1024, False, "auto", "C++ CPU kernel"),
    (CPU, torch.float32, None, 1024, False, "auto", "C++ CPU kernel"),
    (CPU, torch.float32, 8, 256, False, "auto", "plain PyTorch"),
    (CUDA, torch.bfloat16, 1, 2048, False, "auto", "CUDA decode or dense"),
    (CUDA, torch.bfloat16, 16384, 2048, False, "auto", "CUDA TwELL or dense"),
    (CUDA, torch.float32, 16384, 2048, False, "auto", "dense (eager's calls)"),
    (CUDA, torch.bfloat16, 16384, 2048, True, "auto", "CUDA sparse training kernels"),
    (CUDA, torch.bfloat16, 16384, 1024, True, "auto", "CUDA dense training path (K=1024"),
    (CUDA, torch.bfloat16, 16384, 2048, False, "twell", "forced: twell"),
])
def test_static_path_says_what_a_rewritten_ffn_runs(device, dtype, m, k, training, path, want):
    """explain's "runs" column: which implementation the op takes, from compile-time facts."""
    assert select.static_path(device, dtype, m, k, 4 * k, k, training=training, path=path).startswith(want)


def test_compaction_takes_fewer_rows_per_program_at_small_token_counts():
    p = arch.H100
    got = {m: p.compact_rows_per_program(m) for m in (1, 2048, 8192, 16384, 32768, 65536, 1 << 20)}
    assert got == {1: 4, 2048: 4, 8192: 4, 16384: 8, 32768: 16, 65536: 16, 1 << 20: 16}
    assert dataclasses.replace(p, compact_bm=16, compact_programs=1).compact_rows_per_program(2048) == 16


def test_patched_records_apply_nest_and_lift():
    base = arch.cuda_default()
    with arch.patched(row_stages=7):
        first = arch.cuda_default()
        assert first.row_stages == 7 and arch.cuda_default() is first     # one record per base
        with arch.patched(row_stages=9, compact_bm=8):
            inner = arch.cuda_default()
            assert (inner.row_stages, inner.compact_bm) == (9, 8)
        after = arch.cuda_default()
        assert (after.row_stages, after.compact_bm) == (7, base.compact_bm)
    assert arch.cuda_default() == base and arch.cuda_default().row_stages == base.row_stages


def test_launch_key_names_every_launch_size_a_graph_bakes_in():
    """Records with equal launch sizes share a key (a graph captured under one replays under
    the other); any launch field changed, or a patched block's record, gives another; fields the
    launchers do not read (the cost model's) change nothing."""
    base = arch.cuda_default()
    assert base.launch_key == dataclasses.replace(base).launch_key
    for field in ("row_buckets", "compact_stages", "gate_cfg", "merge_bm", "dense_block", "eager_elementwise_max_m"):
        assert dataclasses.replace(base, **{field: getattr(base, field) + 1}).launch_key != base.launch_key, field
    assert dataclasses.replace(base, pair_units=base.pair_units * 2).launch_key == base.launch_key
    with arch.patched(row_buckets=base.row_buckets + 1):
        assert arch.cuda_default().launch_key != base.launch_key
    with arch.patched(op_rows_host_us=1.0):
        assert arch.cuda_default().launch_key == base.launch_key

