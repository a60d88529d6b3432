"""relu_mul_rows (the CUDA dense path's elementwise pass + statistics) under TRITON_INTERPRET=1:
h bit-identical to eager, exact non-zero counts (NaN counted), |h| sums, odd and strided shapes;
squared ReLU and dReLU too."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from twell_compile.runtime import arch, cuda_infer
    # several column steps on small rows; 1 program: one span per row, 64: rows split into spans
    PATCH = arch.patched(dense_block=64, dense_programs={programs})   # held: a context manager nothing
    PATCH.__enter__()                       # refers to is closed at once
    torch.manual_seed({seed})
    m, n, gated, strided, bad = {case}
    act = {act!r}
    dt = torch.float16
    big = torch.randn(m, n + 7).to(dt)
    g = big[:, 3:n + 3] if strided else big[:, :n].contiguous()
    u = torch.randn(m, n).to(dt) if gated else None
    if bad and m > 2:
        g[0, 1] = float("nan"); g[1, 2] = float("inf"); g[2, 0] = -float("inf")
    h, cnt, asum = cuda_infer.relu_mul_rows(g, u, act)
    a = torch.relu(g) ** 2 if act == "relu2" else torch.relu(g)         # eager's spelling
    eager = a * (torch.relu(u) if act == "drelu" else u) if gated else a
    assert torch.equal(h.isnan(), eager.isnan()), "nan pattern"
    ok = ~eager.isnan()
    assert torch.equal(h[ok], eager[ok]), "h not bit-identical to eager"
    want = ((g > 0) | g.isnan()).sum(1)
    assert torch.equal(cnt.long(), want), (cnt, want)
    ref = eager.float().abs().sum(1)
    fin = ref.isfinite()
    assert torch.equal(asum.isfinite(), fin), "non-finite sums"
    assert torch.allclose(asum[fin], ref[fin], rtol=1e-5, atol=1e-5), (asum, ref)
    print("ok", int(want.sum()))
""")

CASES = [
    # m, n, gated, strided g, nan/inf in g
    (5, 200, True, False, False),    # several column steps, partial last step
    (4, 70, False, True, True),      # non-gated, strided rows, NaN/Inf/-Inf
    (3, 64, True, True, True),       # gated, NaN/Inf in g
    (1, 1, True, False, False),      # single element
    (0, 50, True, False, False),     # no rows
]


@pytest.mark.parametrize("programs", [1, 64])
@pytest.mark.parametrize("case", CASES)
def test_relu_mul_rows_under_interpreter(case, programs):
    run_interpreted(SCRIPT.format(seed=sum(case[:2]), case=case, programs=programs, act="relu"))


@pytest.mark.parametrize("act, case", [("relu2", CASES[0]), ("relu2", CASES[1]), ("relu2", CASES[2]),
                                       ("drelu", CASES[0]), ("drelu", CASES[2])])
def test_activations_under_interpreter(act, case):
    run_interpreted(SCRIPT.format(seed=sum(case[:2]) + 1, case=case, programs=64, act=act))
