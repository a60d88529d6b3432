"""Compile-time dispatch facts: when the inference op would surely run dense on CUDA."""

import torch

from twell_compile import dispatch
from twell_compile.kernels import cuda_policy

CUDA = torch.device("cuda")


def test_cpu_never_skipped():
    assert dispatch.static_dense_reason(torch.device("cpu"), torch.float32, 1, 16, 40, 16) is None


def test_cuda_fp32_is_dense():
    why = dispatch.static_dense_reason(CUDA, torch.float32, 65536, 2048, 5632, 2048)
    assert why and "float32" in why


def test_cuda_static_tokens_between_the_sparse_paths_are_dense_but_dynamic_tokens_are_not():
    for few in (cuda_policy.DECODE_MAX_M + 1, cuda_policy.MIN_TOKENS - 1):
        assert f"{few} tokens" in dispatch.static_dense_reason(CUDA, torch.bfloat16, few, 2048, 5632, 2048)
    for m in (cuda_policy.MIN_TOKENS, None):   # per-row, dynamic (decode sizes: tests/kernels/test_decode.py)
        assert dispatch.static_dense_reason(CUDA, torch.bfloat16, m, 2048, 5632, 2048) is None


def test_cuda_width_limits_apply_at_prefill_sizes_only():
    big = cuda_policy.MIN_TOKENS
    narrow = dispatch.static_dense_reason(CUDA, torch.bfloat16, big, 512, 1408, 512)
    assert narrow and "K=512" in narrow                    # issue 6's model: 0.71x on the per-row path
    assert dispatch.static_dense_reason(CUDA, torch.bfloat16, None, 512, 1408, 512) is None
    assert dispatch.static_dense_reason(CUDA, torch.bfloat16, 1, 512, 1408, 512) is None   # decode: 1.5x+
    assert "wide" in dispatch.static_dense_reason(CUDA, torch.float16, big, cuda_policy.MAX_WIDTH + 1, 64, 64)
    assert "wide" in dispatch.static_dense_reason(CUDA, torch.float16, big, 64, cuda_policy.MAX_N + 1, 64)
    # a dynamic M may be decode-sized: the decode path takes any width
    assert dispatch.static_dense_reason(CUDA, torch.float16, None, 64, cuda_policy.MAX_N + 1, 64) is None


def test_training_reasons_on_cuda_only_for_slow_paths():
    from twell_compile.kernels import cuda_train
    cpu = torch.device("cpu")
    assert dispatch.static_dense_train_reason(cpu, torch.float32, 16, 2048, 5632, 2048) is None
    assert "float32" in dispatch.static_dense_train_reason(CUDA, torch.float32, 65536, 2048, 5632, 2048)
    few = cuda_train.MIN_TOKENS - 1
    assert f"{few} tokens" in dispatch.static_dense_train_reason(CUDA, torch.bfloat16, few, 2048, 5632, 2048)
    assert "wide" in dispatch.static_dense_train_reason(CUDA, torch.float16, None, cuda_policy.MAX_WIDTH + 1, 64, 64)
    for m in (cuda_train.MIN_TOKENS, None):   # the sparse branch is reachable: keep the rewrite
        assert dispatch.static_dense_train_reason(CUDA, torch.bfloat16, m, 2048, 5632, 2048) is None


def test_training_dynamic_token_counts_are_answered_under_a_guard():
    """A SymInt token count is answered as its hint would be, and the answer joins the shape
    environment's guards (m < MIN_TOKENS or its negation); unbacked counts keep the rewrite."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from twell_compile.kernels import cuda_train

    def tokens(hint):
        env = ShapeEnv()
        b = env.create_symintnode(env.create_symbol(hint, source=ConstantSource("b")), hint=hint)
        return env, b * 4                  # [b, 4, K]: 4b tokens

    env, m = tokens(256)
    why = dispatch.static_dense_train_reason(CUDA, torch.bfloat16, m, 2048, 5632, 2048)
    assert why and "1024 now" in why and "recompiles once" in why
    assert [str(g.expr) for g in env.guards] == [f"{m.node.expr} < {cuda_train.MIN_TOKENS}"]
    env, m = tokens(cuda_train.MIN_TOKENS // 4)
    assert dispatch.static_dense_train_reason(CUDA, torch.bfloat16, m, 2048, 5632, 2048) is None
    assert [str(g.expr) for g in env.guards] == [f"{m.node.expr} >= {cuda_train.MIN_TOKENS}"]
    env, m = tokens(256)                   # facts that decide without the count add no guard
    assert "float32" in dispatch.static_dense_train_reason(CUDA, torch.float32, m, 2048, 5632, 2048)
    assert dispatch.static_dense_train_reason(torch.device("cpu"), torch.bfloat16, m, 2048, 5632, 2048) is None
    assert not env.guards
    env = ShapeEnv()
    u = env.create_unbacked_symint()
    assert dispatch.static_dense_train_reason(CUDA, torch.bfloat16, u * 4, 2048, 5632, 2048) is None
    assert not env.guards


def test_inference_dynamic_token_counts_are_guarded_to_their_range():
    """A SymInt count is answered as its hint is, and the range the hint is in (decode-sized,
    the band, per-row sized) joins the shape environment's guards; facts that decide without
    the count add no guard; unbacked counts keep the rewrite."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    lo, hi = cuda_policy.DECODE_MAX_M, cuda_policy.MIN_TOKENS

    def tokens(hint):
        env = ShapeEnv()
        return env, env.create_symintnode(env.create_symbol(hint, source=ConstantSource("m")), hint=hint)

    def guards(env):
        return sorted(str(g.expr) for g in env.guards)

    env, m = tokens(1024)
    why = dispatch.static_dense_reason(CUDA, torch.bfloat16, m, 2048, 5632, 2048)
    assert why and "1024 now" in why and f"guarded to {lo + 1}-{hi - 1} tokens" in why and "decode path" in why
    assert guards(env) == sorted([f"{m.node.expr} < {hi}", f"{m.node.expr} >= {lo + 1}"])
    for cudagraphs in (False, True):       # decode-sized: the CUDA-graph rule as for a static count
        env, m = tokens(2)
        why = dispatch.static_dense_reason(CUDA, torch.bfloat16, m, 2048, 5632, 2048, cudagraphs=cudagraphs)
        assert (why is None) == cudagraphs and (cudagraphs or f"guarded to <= {lo}" in why)
        assert guards(env) == [f"{m.node.expr} < {lo + 1}"]
    env, m = tokens(hi)
    assert dispatch.static_dense_reason(CUDA, torch.bfloat16, m, 2048, 5632, 2048) is None
    assert guards(env) == sorted([f"{m.node.expr} >= {lo + 1}", f"{m.node.expr} >= {hi}"])
    env, m = tokens(hi)                    # per-row sized: the width rules apply
    assert "wide" in dispatch.static_dense_reason(CUDA, torch.bfloat16, m, 64, cuda_policy.MAX_N + 1, 64)
    env, m = tokens(1024)                  # decided without the count: no guard
    assert "float32" in dispatch.static_dense_reason(CUDA, torch.float32, m, 2048, 5632, 2048)
    assert dispatch.static_dense_reason(torch.device("cpu"), torch.bfloat16, m, 2048, 5632, 2048) is None
    assert not env.guards
    env = ShapeEnv()
    assert dispatch.static_dense_reason(CUDA, torch.bfloat16, env.create_unbacked_symint(), 2048, 5632, 2048) is None
    assert not env.guards


def test_cuda_decode_sizes_need_cuda_graphs():
    """Without CUDA graphs the decode step is host-bound and the rewrite lost end to end (H200,
    0.63x at batch 1): static decode-sized FFNs then stay with Inductor; dynamic M does not."""
    why = dispatch.static_dense_reason(CUDA, torch.bfloat16, 1, 2048, 5632, 2048, cudagraphs=False)
    assert why and "without CUDA graphs" in why and "twell.cudagraphs" in why
    assert dispatch.static_dense_reason(CUDA, torch.bfloat16, 1, 2048, 5632, 2048, cudagraphs=True) is None
    assert dispatch.static_dense_reason(CUDA, torch.bfloat16, None, 2048, 5632, 2048, cudagraphs=False) is None
    big = cuda_policy.MIN_TOKENS
    assert dispatch.static_dense_reason(CUDA, torch.bfloat16, big, 2048, 5632, 2048, cudagraphs=False) is None
    cpu = torch.device("cpu")
    assert dispatch.static_dense_reason(cpu, torch.float32, 1, 2048, 5632, 2048, cudagraphs=False) is None
