"""Triton device helpers shared by the row kernels: walking a chunk of columns active pair by
active pair (twell_rows.py's exact tail, the training forward's and backward's busy rows).

A chunk is CH columns of one row; ``act`` marks its active ones (relu(g) != 0, or every column
of a row with non-finite x). PAIRS of them are taken per step: ``scan`` gives the running count,
``select`` the mask of the j-th active column for j = q+1 .. q+PAIRS and their columns, ``pick``
a value at them. Selection by prefix count keeps the loop free of data-dependent indexing.
"""

import triton
import triton.language as tl


@triton.jit
def scan(act):
    """(inclusive prefix count [CH] int32, active columns in the chunk) of a chunk's mask."""
    ai = act.to(tl.int32)
    return tl.cumsum(ai, axis=0), tl.sum(ai, axis=0)


@triton.jit
def select(act, incl, na, q, pa, c0, cc):
    """The (q + pa + 1)-th active columns (pa = arange(PAIRS)): (mask [PAIRS, CH], live
    [PAIRS], column index [PAIRS] int64; column c0 for dead lanes)."""
    j = q + pa + 1
    sel = act[None, :] & (incl[None, :] == j[:, None])
    live = j <= na
    col = (c0 + tl.sum(tl.where(sel, cc[None, :], 0), axis=1)).to(tl.int64)
    return sel, live, col


@triton.jit
def pick(sel, v):
    """v [CH] at the selected columns: [PAIRS] (0 for dead lanes)."""
    return tl.sum(tl.where(sel, v[None, :], 0.0), axis=1)
