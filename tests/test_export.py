"""torch.export with the rewrite, and an AOTInductor package run in a fresh process."""

import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import twell_compile


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(16, 40), nn.Linear(16, 40), nn.Linear(40, 16)
        self.fc1, self.fc2 = nn.Linear(16, 24), nn.Linear(24, 16)

    def forward(self, x):
        x = x + self.down(F.relu(self.gate(x)) * self.up(x))
        return x + self.fc2(torch.relu(self.fc1(x)))


def test_export_rewrites_and_matches_eager():
    torch.manual_seed(0)
    m = Block().eval()
    x = torch.randn(3, 5, 16)
    ep, report = twell_compile.export(m, (x,))
    assert len(report.rewrites) == 2 and {r.gated for r in report.rewrites} == {True, False}
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.twell.ffn.default) == 2
    assert torch.ops.aten.relu.default not in targets
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), m(x), atol=1e-5, rtol=1e-5)


def test_export_argument_errors():
    with pytest.raises(TypeError, match="model must be"):
        twell_compile.export(lambda x: x, (torch.randn(2),))
    with pytest.raises(TypeError, match="args must be a tuple"):
        twell_compile.export(Block(), torch.randn(2, 16))
    with pytest.raises(ValueError, match="only twell"):
        twell_compile.export(Block(), (torch.randn(2, 16),), options={"max_autotune": True})


@pytest.mark.skipif(torch.__version__ < (2, 13),
                    reason="AOTInductor on torch 2.11 segfaults calling Python custom ops (seen on the H200 machine)")
def test_aoti_package_runs_in_fresh_process(tmp_path):
    torch.manual_seed(1)
    m = Block().eval()
    x = torch.randn(4, 16)
    ep, _ = twell_compile.export(m, (x,))
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "ffn.pt2"))
    torch.save({"x": x, "y": m(x).detach()}, tmp_path / "io.pt")
    run = ("import torch{imp}\n"
           f"d = torch.load({str(tmp_path / 'io.pt')!r})\n"
           f"r = torch._inductor.aoti_load_package({pkg!r})\n"
           "torch.testing.assert_close(r(d['x']), d['y'], atol=1e-5, rtol=1e-5)\n"
           "print('ok')\n")
    ok = subprocess.run([sys.executable, "-c", run.format(imp=", twell_compile.ops")],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and ok.stdout.strip().endswith("ok"), ok.stderr[-3000:]
    # Without registering the ops the documented error names what is missing.
    bad = subprocess.run([sys.executable, "-c", run.format(imp="")], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "twell::ffn" in bad.stderr
