"""examples/quickstart.py: the shapes it runs on a CPU are rewritten to the C++ kernel, and its
timing line names a C++ build made in this run."""

import shutil

import pytest
import torch

import twell_compile
from tests.helpers import load_example

Q = load_example("quickstart")


def test_the_timing_line_names_a_build_of_this_run():
    assert Q.timing_line(20.4, 9.2, {}) == "demo took 20 s (compiling both models: 9 s)"
    assert Q.timing_line(130.2, 9.4, {"twell_cpu_ffn": 65.1}) == (
        "demo took 130 s (compiling both models: 9 s; building the C++ kernel twell_cpu_ffn, first run only: 65 s)")


@pytest.mark.skipif(shutil.which("c++") is None, reason="the CPU rewrite needs the C++ kernel built")
def test_the_cpu_demo_is_rewritten_to_the_cpu_kernel():
    model, tokens = Q.demo_model("cpu", layers=1)
    with torch.no_grad():
        report = twell_compile.explain(model, tokens)
    assert [(r.layer, r.k, r.n, r.runs) for r in report.rewrites] == [("layers.0.mlp", 1024, 2816, "C++ CPU kernel")]
    assert not report.rejections and tokens.shape == (1, 512)
