"""The inference density rule (cuda_policy.twell_wins, rule 2) against the committed H200
measurements it was fitted to (CPU: the rule is host arithmetic)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twell_compile.kernels import cuda_policy

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200" / "ffn_inference.json"


def _rows():
    rows = [r for r in json.loads(RESULTS.read_text())
            if r["M"] >= cuda_policy.MIN_TOKENS and r.get("kernel_ms") and r["kernel_ms"] == r["kernel_ms"]]
    assert len(rows) >= 20, len(rows)
    return rows


def _sparse_ms(r):
    """TwELL's time at a point: the forced kernel's, or the op's where the op ran TwELL too (two
    timings of the same kernels in one run; they differ by up to 14% at tail 0.2, run 7).
    Rows from session 17 on time the op as op_ms (op_path) and the compiled module as twell_ms."""
    op_ms, op_path = r.get("op_ms", r["twell_ms"]), r.get("op_path", r["path"])
    return min(r["kernel_ms"], op_ms) if op_path == "twell" else r["kernel_ms"]


def _wins(r):
    return cuda_policy.twell_wins(r["nnz_per_row"] / r["N"], True, r["K"], r["N"], r["K"], 2)


def test_rule_never_picks_a_kernel_slower_than_inductor():
    """Where the rule runs TwELL, the forced kernel measured at most 3% over Inductor (the
    noise between runs of one point), tails included."""
    bad = [(r["M"], r["K"], r["density"], r["tail"], _sparse_ms(r), r["inductor_ms"])
           for r in _rows() if _wins(r) and _sparse_ms(r) > 1.03 * r["inductor_ms"]]
    assert not bad, bad


def test_rule_leaves_no_large_kernel_win_dense():
    """Where the rule runs dense, the forced kernel was not more than 1.1x faster than Inductor."""
    bad = [(r["M"], r["K"], r["density"], r["tail"], _sparse_ms(r), r["inductor_ms"])
           for r in _rows() if not _wins(r) and _sparse_ms(r) * 1.1 < r["inductor_ms"]]
    assert not bad, bad


@pytest.mark.parametrize("k,n,limit", [(2048, 5632, 0.0114), (4096, 11008, 0.0072)])
def test_break_even_density_follows_the_weights_l2_residency(k, n, limit):
    """W_u + W_d in L2 (46 MB at K=2048) gather faster per pair than from HBM (180 MB)."""
    assert cuda_policy.twell_wins(0.99 * limit, True, k, n, k, 2)
    assert not cuda_policy.twell_wins(1.01 * limit, True, k, n, k, 2)


# ------------------------------------------------------------------ state per op instance
class _PolicyOnCpu:
    """Stands in for kernels/cuda_infer.py at prefill sizes, on CPU tensors: per call the same
    policy calls (its key, use_twell, wants_probe, tick), the probe landing at once (no CUDA
    event), eager's math. Records the path of each call."""

    def __init__(self):
        self.paths = []

    def ffn_infer(self, x, w_gate, b_gate, w_up, b_up, w_down, b_down, tile_n, slots, layer, keep_stats):
        import torch
        import torch.nn.functional as F

        from twell_compile.kernels import torch_impl

        k, n, k_out, gated = x.shape[-1], w_gate.shape[0], w_down.shape[0], w_up is not None
        key = (layer, x.device, x.dtype, k, n, k_out, gated)
        sparse = cuda_policy.use_twell(key, gated, k, n, k_out, 2)
        if cuda_policy.wants_probe(key, sparse):
            h = torch.relu(F.linear(x, w_gate, b_gate))
            cuda_policy._state(key).density = float((h != 0).float().mean())
        cuda_policy.tick(key)
        self.paths.append("twell" if sparse else "dense")
        return torch_impl.ffn_infer(x, w_gate, b_gate, w_up, b_up, w_down, b_down, layer, False)


def _net(gate_bias):
    import torch
    from torch import nn

    class FFN(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(64, 256), nn.Linear(64, 256), nn.Linear(256, 64)
            nn.init.constant_(self.gate.bias, gate_bias)    # -3: ~nothing fires; +3: ~everything

        def forward(self, x):
            return self.down(torch.relu(self.gate(x)) * self.up(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = FFN()

        def forward(self, x):
            return x + self.mlp(x)

    return Net()


@pytest.fixture
def policy_on_cpu(monkeypatch):
    import torch

    from twell_compile import dispatch

    stand_in = _PolicyOnCpu()
    monkeypatch.setattr(dispatch, "_cuda_infer", lambda x: stand_in)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    cuda_policy.reset()
    yield stand_in
    cuda_policy.reset()


def test_a_second_model_with_the_same_layer_names_starts_unmeasured(policy_on_cpu):
    """Two compiled models with one layer name ("mlp") and shapes: the dense one's measurement
    is not the sparse one's (it would keep it dense until its next probe, 64 calls on); each
    starts with a probe and the sparse one runs TwELL from its second call."""
    import torch

    x = torch.randn(4, 64)
    with torch.no_grad():
        dense = torch.compile(_net(3.0), backend="twell")
        for _ in range(3):
            dense(x)
        assert policy_on_cpu.paths == ["dense"] * 3
        policy_on_cpu.paths.clear()
        sparse = torch.compile(_net(-3.0), backend="twell")
        for _ in range(3):
            sparse(x)
    assert policy_on_cpu.paths == ["dense", "twell", "twell"]


def test_dynamo_reset_and_a_new_compile_start_fresh(policy_on_cpu):
    import torch

    x = torch.randn(4, 64)
    net = _net(-3.0)
    with torch.no_grad():
        for _ in range(2):
            torch.compile(net, backend="twell")(x)
        assert policy_on_cpu.paths == ["dense", "twell"]
        torch._dynamo.reset()                        # the backend's reset hook clears the state
        assert not cuda_policy._layers
        policy_on_cpu.paths.clear()
        torch.compile(net, backend="twell")(x)       # a new compile: a probe first again
        assert policy_on_cpu.paths == ["dense"]
        # without the reset, a new compile's ops are other instances, with their own state
        measured = dict(cuda_policy._layers)
        torch._dynamo.reset()
        cuda_policy._layers.update(measured)
        policy_on_cpu.paths.clear()
        torch.compile(net, backend="twell")(x)
    assert policy_on_cpu.paths == ["dense"]


def test_state_is_per_op_instance():
    key = ("mlp", "cpu", "bf16", 64, 256, 64, True)
    cuda_policy.reset()
    try:
        prev = cuda_policy.enter(7)
        cuda_policy._state(key).density = 0.5
        assert cuda_policy.instance() == 7 and cuda_policy.density(key) == 0.5
        cuda_policy.enter(8)
        assert cuda_policy.density(key) is None            # same name and shapes, another op
        cuda_policy.enter(prev)
        assert cuda_policy.density(key) is None            # direct calls: instance 0
        cuda_policy.enter(7)
        assert cuda_policy.density(key) == 0.5
    finally:
        cuda_policy.enter(0)
        cuda_policy.reset()
