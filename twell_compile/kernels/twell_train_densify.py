"""Triton device code: the dense training backward's elementwise step from the saved hybrid
state (a dense layer that saved the compact state instead of g and u).

With dh = dy W_d^T already in ``dh`` ([M, N]), h_g = relu(g) and u from the hybrid state:

    dh' = dh (+ l1c * sgn(h); l1c times *l1_ptr with L1_DEV),  d_g = dh' * u * [not h_g <= 0],  d_u = dh' * h_g,  h = h_g * u

(ReLU; ACT forms h and the derivatives of squared ReLU or dReLU from the same h_g and u:
kernels/act.py, whose rule for dReLU's d_u off the active pairs, dh * 0, is the one here.)

written whole into dg, du ([M, N]) and h (into dh's buffer), one program per row. Off the
active pairs h_g = 0: d_g = 0, h = 0 and d_u = dh * 0 (NaN where dh is not finite, as eager's
mul backward gives), so a quiet row (count <= W, finite x) reads u and h_g only at its ELL
slots: the slots' dh are gathered first, the row is then written as if inactive, and the
slots' values are scattered over it; CTA barriers order the three steps (the stores of one
element come from different threads). A busy row takes h_g and u from its dense-backup row,
or, past the backup, recomputes g and u from x (exact, slow: N / CH steps of [CH, K] weight
tiles per row, not timed; the policy keeps layers with such rows on the save-g-and-u path). Same formulas and rounding as
twell_train_dense.py.
"""

import triton
import triton.language as tl

from twell_compile.kernels.act import grads, hidden
from twell_compile.kernels.twell_train_bwd import recompute


@triton.jit
def _terms(dh, hg, u, l1c, dt, GATED: tl.constexpr, L1: tl.constexpr, ACT: tl.constexpr):
    """(d_g, d_u, h) in fp32 from fp32 dh, h_g, u (u = h_g when non-gated); h and the
    derivatives of the activation ACT (kernels/act.py)."""
    h = hidden(hg, u, GATED, ACT).to(dt).to(tl.float32)
    if L1:
        dh += l1c * (tl.where(h > 0.0, 1.0, 0.0) - tl.where(h < 0.0, 1.0, 0.0))
    dg, du = grads(dh, hg, u, GATED, ACT)                            # NaN passes
    return dg, du, h


@triton.jit
def _write_chunk(dh_ptr, dg_ptr, du_ptr, at, c_ok, hg, u, l1c, dt,
                 GATED: tl.constexpr, L1: tl.constexpr, ACT: tl.constexpr):
    """A busy row's columns ``at``: d_g, d_u stored; h over the chunk's dh once it is read."""
    dh = tl.load(dh_ptr + at, mask=c_ok, other=0.0).to(tl.float32)
    dg, du, h = _terms(dh, hg, u, l1c, dt, GATED, L1, ACT)
    tl.store(dg_ptr + at, dg.to(dt), mask=c_ok)
    if GATED:
        tl.store(du_ptr + at, du.to(dt), mask=c_ok)
    tl.debug_barrier()                          # every dh of the chunk read before h lands
    tl.store(dh_ptr + at, h.to(dt), mask=c_ok)


@triton.jit
def train_densify_kernel(dh_ptr, dg_ptr, du_ptr, cnt_ptr, cols_ptr, eg_ptr, eu_ptr, W,
                         slot_ptr, bg_ptr, bu_ptr, x_ptr, sx_m, wg_ptr, swg_n, bgate_ptr,
                         wu_ptr, swu_n, bup_ptr, N, K, l1c, l1_ptr,
                         GATED: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr,
                         L1: tl.constexpr, L1_DEV: tl.constexpr, W_P: tl.constexpr, K_P: tl.constexpr,
                         CH: tl.constexpr, BK: tl.constexpr, DCH: tl.constexpr, ACT: tl.constexpr):
    """CH columns per step where g and u are recomputed ([CH, BK] weight tiles), DCH where the
    row is only streamed: wide steps keep many elements per thread between barriers
    (docs/design-notes/training.md)."""
    if L1_DEV:                                  # the controller's coefficient (fp32 [1])
        l1c = l1c * tl.load(l1_ptr)
    m = tl.program_id(0).to(tl.int64)
    dt = dh_ptr.dtype.element_ty
    row = m * N
    cc = tl.arange(0, CH)
    ks = tl.arange(0, K_P)
    xr = tl.load(x_ptr + m * sx_m + ks, mask=ks < K, other=0.0).to(tl.float32)
    xbad = tl.sum(((xr != xr) | (tl.abs(xr) == float("inf"))).to(tl.int32), axis=0) > 0
    cnt = tl.load(cnt_ptr + m)
    if (cnt > W) | xbad:
        slot = tl.load(slot_ptr + m)
        if slot >= 0:
            brow = slot.to(tl.int64) * N
            dc = tl.arange(0, DCH)
            for c0 in range(0, N, DCH):
                cn = c0 + dc
                c_ok = cn < N
                hg = tl.load(bg_ptr + brow + cn, mask=c_ok, other=0.0).to(tl.float32)
                if GATED:
                    u = tl.load(bu_ptr + brow + cn, mask=c_ok, other=0.0).to(tl.float32)
                else:
                    u = hg
                _write_chunk(dh_ptr, dg_ptr, du_ptr, row + cn, c_ok, hg, u, l1c, dt, GATED, L1, ACT)
        else:
            for c0 in range(0, N, CH):
                cn = c0 + cc
                c_ok = cn < N
                g = recompute(x_ptr, sx_m, m, wg_ptr, swg_n, bgate_ptr, cn, c_ok, K, dt,
                               HAS_BG, CH, BK).to(tl.float32)
                hg = tl.where(g < 0.0, 0.0, g)                          # relu, NaN kept
                if GATED:
                    u = recompute(x_ptr, sx_m, m, wu_ptr, swu_n, bup_ptr, cn, c_ok, K, dt,
                                   HAS_BU, CH, BK).to(tl.float32)
                else:
                    u = hg
                _write_chunk(dh_ptr, dg_ptr, du_ptr, row + cn, c_ok, hg, u, l1c, dt, GATED, L1, ACT)
    else:
        js = tl.arange(0, W_P)
        live = js < cnt
        n = tl.load(cols_ptr + m * W + js, mask=live, other=0).to(tl.int64)
        hg = tl.load(eg_ptr + m * W + js, mask=live, other=0.0).to(tl.float32)
        if GATED:
            u = tl.load(eu_ptr + m * W + js, mask=live, other=0.0).to(tl.float32)
        else:
            u = hg
        dhs = tl.load(dh_ptr + row + n, mask=live, other=0.0).to(tl.float32)
        dgs, dus, hs = _terms(dhs, hg, u, l1c, dt, GATED, L1, ACT)
        tl.debug_barrier()                      # the slots' dh read before the row is cleared
        dc = tl.arange(0, DCH)
        for c0 in range(0, N, DCH):
            cn = c0 + dc
            c_ok = cn < N
            tl.store(dg_ptr + row + cn, tl.zeros((DCH,), dtype=dt), mask=c_ok)
            if GATED:
                dh = tl.load(dh_ptr + row + cn, mask=c_ok, other=0.0).to(tl.float32)
                tl.store(du_ptr + row + cn, (dh * 0.0).to(dt), mask=c_ok)
                tl.debug_barrier()
            tl.store(dh_ptr + row + cn, tl.zeros((DCH,), dtype=dt), mask=c_ok)
        tl.debug_barrier()                      # the cleared row before the slots' values
        tl.store(dg_ptr + row + n, dgs.to(dt), mask=live)
        if GATED:
            tl.store(du_ptr + row + n, dus.to(dt), mask=live)
        tl.store(dh_ptr + row + n, hs.to(dt), mask=live)
