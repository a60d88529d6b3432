"""Per-layer density measurements (runtime/density.py): state per op instance, reset with
Dynamo's, probes on schedule. The CUDA tests run two compiled models end to end."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from twell_compile.testing import Block, GatedMLP
from twell_compile.runtime import arch, density

gpu = pytest.mark.gpu
KEY = ("mlp", "cpu", "bf16", 64, 256, 64, True)


@pytest.fixture(autouse=True)
def _fresh_state():
    density.reset()
    yield
    density.reset()


def test_state_is_per_op_instance():
    with density.scope(7):
        density.landed(KEY, 0.5)
        assert density.instance() == 7 and density.measured(KEY) == 0.5
        with density.scope(8):
            assert density.measured(KEY) is None            # same name and shapes, another op
    assert density.instance() == 0
    assert density.measured(KEY) is None                    # direct calls: instance 0
    with density.scope(7):
        assert density.measured(KEY) == 0.5


def test_probes_follow_their_interval_and_the_path_is_recorded():
    assert density.wants_probe(KEY, 4)                      # unmeasured: probe
    density.landed(KEY, 0.01)
    seen = []
    for _ in range(8):
        seen.append(density.wants_probe(KEY, 4))
        density.tick(KEY, "twell")
    assert seen == [True, False, False, False, True, False, False, False]
    assert density.last_path(KEY) == "twell"


def test_dynamo_reset_clears_every_instance():
    with density.scope(3):
        density.landed(KEY, 0.2)
    assert density.layers() == 1
    torch._dynamo.reset()           # the backend's reset hook (only once the backend compiled)
    torch.compile(nn.Linear(4, 4), backend="twell")(torch.randn(2, 4))
    with density.scope(3):
        density.landed(KEY, 0.2)
    torch._dynamo.reset()
    assert density.layers() == 0


def _net(gate_bias: float, k: int = 256, n: int = 1024) -> nn.Module:
    """A fresh Block subclass per call: Dynamo guards on a module's class, so each model gets its
    own graph and op instance (two models of one class share Dynamo's cached graph, and with it
    the instance's density measurement)."""
    class Net(Block):
        pass

    net = Net(GatedMLP(k, n, bias=True), k, norm=False)
    nn.init.constant_(net.mlp.gate.bias, gate_bias)    # -3: ~nothing fires; +3: ~everything
    return net.cuda().to(torch.bfloat16)


def _paths(compiled, x, calls):
    """The path of each call of the newest op instance's "mlp" layer."""
    out = []
    for _ in range(calls):
        compiled(x)
        torch.cuda.synchronize()                 # the probe lands before the next call reads it
        newest = max((inst, path) for inst, key, _, path in density.snapshot() if key[0] == "mlp")
        out.append(newest[1])
    return out


@gpu
def test_a_second_model_with_the_same_layer_names_starts_unmeasured():
    """Two compiled models with one layer name ("mlp") and shapes: the dense one's measurement
    is not the sparse one's (it would keep it dense until its next probe, 64 calls on); each
    starts with a probe and the sparse one runs TwELL from its second call. The per-row path's
    token and width thresholds are lowered to this test's sizes."""
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), arch.patched(min_tokens=32, min_width=64):
        dense = torch.compile(_net(3.0), backend="twell")
        assert _paths(dense, x, 3) == ["dense"] * 3
        sparse = torch.compile(_net(-3.0), backend="twell")
        assert _paths(sparse, x, 3) == ["dense", "twell", "twell"]


@gpu
def test_dynamo_reset_and_a_new_compile_start_fresh():
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    net = _net(-3.0)
    with torch.no_grad(), arch.patched(min_tokens=32, min_width=64):
        assert _paths(torch.compile(net, backend="twell"), x, 2) == ["dense", "twell"]
        torch._dynamo.reset()
        assert density.layers() == 0
        assert _paths(torch.compile(net, backend="twell"), x, 1) == ["dense"]   # a probe first again


def test_landed_measurements_carry_the_rows_peak():
    """A measurement lands with its heaviest row's non-zeros where the probe carried it (None
    where not), and a later one without a peak forgets the earlier peak."""
    density.landed(KEY, 0.01, 169.0)
    assert density.measured(KEY) == 0.01 and density.peak(KEY) == 169.0
    density.landed(KEY, 0.02)
    assert density.measured(KEY) == 0.02 and density.peak(KEY) is None


def test_submit_takes_a_count_or_a_count_and_a_peak():
    with pytest.raises(ValueError, match="1 or 2 elements"):
        density.submit(KEY, torch.zeros(3), 10)


@gpu
@pytest.mark.parametrize("fields", [1, 2])
def test_a_probe_reads_back_its_count_and_peak_without_a_sync(fields):
    """submit's readback: the count over the elements lands as the density, the second field
    as the peak; nothing is read before the event has landed (take_landed never waits)."""
    buf = torch.tensor([300.0, 17.0], dtype=torch.float64, device="cuda")
    density.submit(KEY, buf[:fields], 1000)
    torch.cuda.synchronize()
    assert density.poll(KEY) == pytest.approx(0.3)
    assert density.peak(KEY) == (17.0 if fields == 2 else None)
