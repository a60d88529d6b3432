"""runtime/cuda_infer.py on the CPU under TRITON_INTERPRET=1: the dense call graphed by
``dense_graphed`` (its first call runs eagerly, outside any graph: what it computes and where its
statistics go; capture and replay are the GPU tests' in test_cuda_infer.py)."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    import twell_compile
    from twell_compile import stats
    from twell_compile.reference import ffn_dense
    from twell_compile.runtime import cuda_infer, decode_graphs
    from twell_compile.testing import make_ffn
    keep_stats, probe, gated = {case}
    p = make_ffn(8, 64, 256, 0.1, 0.0, gated=gated, dtype=torch.bfloat16, device="cpu", seed=3)
    args = (p["x"], p["w_gate"], None, p["w_up"], None, p["w_down"], None)
    buf = stats.reserve("layer", torch.device("cpu")).fill_(float("nan")) if keep_stats else None   # poisoned
    decode_graphs.clear()
    y, total = cuda_infer.dense_graphed(*args, buf, probe)
    ref = ffn_dense(*(None if a is None else a.float() for a in args))
    err = float((y.float() - ref).norm() / ref.norm())
    eager = float((ffn_dense(*args).float() - ref).norm() / ref.norm())
    assert err <= 2 * eager + 1e-6, (err, eager)
    nnz = int((F.linear(p["x"], p["w_gate"]) > 0).sum())
    if not keep_stats and not probe:
        assert total is None
    else:
        peak = int((F.linear(p["x"], p["w_gate"]) > 0).sum(1).max())
        assert total.tolist() == [nnz, peak], (total.tolist(), nnz, peak)   # the probe's count and peak row
    if keep_stats:
        got = buf.tolist()
        assert got[0] == nnz and got[3] == 0, got
    print("ok", nnz)
""")


@pytest.mark.parametrize("case", [(False, False, True), (False, True, True), (True, False, True), (True, True, False)])
def test_dense_graphed_first_call_takes_the_statistics_it_is_asked_for(case):
    run_interpreted(SCRIPT.format(case=case))
