"""row_stats_kernel (the CUDA inference paths' statistics in one launch) under TRITON_INTERPRET=1:
the buffer's four fields against plain PyTorch on fresh random counts and |h| sums, with and
without overflow counting, over several BLOCK steps, one row and no rows; the buffer poisoned first."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    import twell_compile
    from twell_compile import stats
    from twell_compile.runtime import cuda_infer
    torch.manual_seed({seed})
    m, n, width = {case}
    cnt = torch.randint(0, n + 1, (m,), dtype=torch.int32)
    hsum = torch.rand(m) * 100
    stats.reserve("layer", torch.device("cpu")).fill_(float("nan"))      # poisoned
    buf = cuda_infer.record_stats("layer", cnt, hsum, width, n)
    want = [float(cnt.double().sum()), float(cnt.max()) if m else 0.0, float(hsum.double().sum()),
            float((cnt > width).sum()) if width else 0.0]
    got = buf.tolist()
    assert got[0] == want[0] and got[1] == want[1] and got[3] == want[3], (got, want)
    assert abs(got[2] - want[2]) <= 1e-9 * max(1.0, want[2]), (got, want)
    st = twell_compile.layer_stats()["layer"]
    assert st.tokens == m and st.hidden == n and st.overflows == int(want[3]), st
    print("ok", got)
""")

CASES = [
    # m, n, width (0: no overflow count)
    (2500, 300, 64),     # one block, partial; some rows over the width
    (20000, 300, 64),    # three blocks of 8192, partial last
    (700, 50, 0),        # dense path: no overflows
    (1, 9, 4),           # one row
    (0, 16, 8),          # no rows: zeros
]


@pytest.mark.parametrize("case", CASES)
def test_row_stats_under_interpreter(case):
    run_interpreted(SCRIPT.format(seed=sum(case), case=case))
