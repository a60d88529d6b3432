"""Triton device code: a layer's statistics from its per-row counts, in one launch.

The statistics buffer (twell_compile/stats.py: sum and max of non-zeros per row, sum of |h|,
rows over the list width) filled in one launch instead of 8-12 small aten calls, whose host
time outweighed the op's GPU time (docs/design-notes/host.md).
"""

import triton
import triton.language as tl

from twell_compile.kernels.pdl import pdl_enter


@triton.jit
def row_stats_kernel(cnt_ptr, hsum_ptr, lost_ptr, out_ptr, M, W, BLOCK: tl.constexpr, OVERFLOW: tl.constexpr,
                     PDL: tl.constexpr):
    """One program: out (fp64 [4]) = (sum of cnt, max of cnt, sum of hsum, overflows) over M
    rows of int32 cnt and fp32 hsum; overflows by OVERFLOW: 0 none, 1 the rows with cnt > W
    (inference's list width), 2 the int32 at lost_ptr (training's rows past the dense backup).
    PDL: launched with programmatic dependent launch (kernels/pdl.py)."""
    pdl_enter(PDL)
    offs = tl.arange(0, BLOCK)
    tot = tl.zeros([BLOCK], dtype=tl.int64)
    mx = tl.zeros([BLOCK], dtype=tl.int32)
    hs = tl.zeros([BLOCK], dtype=tl.float64)
    ov = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, M, BLOCK):
        idx = start + offs
        ok = idx < M
        c = tl.load(cnt_ptr + idx, mask=ok, other=0)
        tot += c.to(tl.int64)
        mx = tl.maximum(mx, c)
        hs += tl.load(hsum_ptr + idx, mask=ok, other=0.0).to(tl.float64)
        if OVERFLOW == 1:
            ov += (c > W).to(tl.int32)
    tl.store(out_ptr, tl.sum(tot, axis=0).to(tl.float64))
    tl.store(out_ptr + 1, tl.max(mx, axis=0).to(tl.float64))
    tl.store(out_ptr + 2, tl.sum(hs, axis=0))
    if OVERFLOW == 2:
        tl.store(out_ptr + 3, tl.load(lost_ptr).to(tl.float64))
    else:
        tl.store(out_ptr + 3, tl.sum(ov, axis=0).to(tl.float64))
