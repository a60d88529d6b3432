"""row_stats_kernel (the CUDA inference paths' statistics in one launch) under TRITON_INTERPRET=1:
the buffer's four fields against plain PyTorch on fresh random counts and |h| sums, with and
without overflow counting and with training's lost-row count, over several BLOCK steps, one row and no rows; the buffer poisoned first."""

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
    m, n, width, lost = {case}
    cnt = torch.randint(0, n + 1, (m,), dtype=torch.int32)
    hsum = torch.rand(m) * 100
    stats.reserve("layer", torch.device("cpu")).fill_(float("nan"))      # poisoned
    lost_t = None if lost is None else torch.tensor(lost, dtype=torch.int32)
    buf = cuda_infer.record_stats("layer", cnt, hsum, n, width, lost=lost_t)
    over = float(lost) if lost is not None and m else float((cnt > width).sum()) if width else 0.0
    want = [float(cnt.double().sum()), float(cnt.max()) if m else 0.0, float(hsum.double().sum()), over]
    got = buf.tolist()
    assert got[0] == want[0] and got[1] == want[1] and got[3] == want[3], (got, want)
    assert abs(got[2] - want[2]) <= 1e-9 * max(1.0, want[2]), (got, want)
    st = twell_compile.layer_stats()["layer"]
    assert st.tokens == m and st.hidden == n and st.overflows == int(want[3]), st
    print("ok", got)
""")

CASES = [
    # m, n, width (0: no overflow count), lost rows (training's overflows; None: inference)
    (2500, 300, 64, None),    # one block, partial; some rows over the width
    (20000, 300, 64, None),   # three blocks of 8192, partial last
    (700, 50, 0, None),       # dense path: no overflows
    (1, 9, 4, None),          # one row
    (0, 16, 8, None),         # no rows: zeros
    (3000, 300, 64, 37),      # training: the lost-row count, not the rows over the width
    (0, 16, 8, 0),            # training, no rows
]


@pytest.mark.parametrize("case", CASES)
def test_row_stats_under_interpreter(case):
    run_interpreted(SCRIPT.format(seed=sum(case[:3]), case=case))
