"""Triton device code: the dense training backward's elementwise step, one pass.

From the saved gate pre-activation g, up projection u and dh = dy W_d (all [M, N], rows of
stride N):

    h_g = relu(g), h = h_g * u (non-gated: h = h_g), dh' = dh (+ l1c * sgn(h); times *l1_ptr with L1_DEV)
    d_g = dh' * u * [not h_g <= 0] -> dg;  d_u = dh' * h_g -> du;  h -> dh's buffer (in place)

Eager runs relu, mul, two mul backwards and threshold_backward as separate passes; this reads
3 and writes 3 [M, N] tensors once. g and u are the forward's saved outputs: never written.
Products in fp32, rounded once to the dtype. With biases (BIAS) each [BM, BN] tile also adds
its column sums of d_g and d_u (fp32, before rounding) into db [2, N] atomically: the bias
grads without a second read of d_g and d_u (docs/design-notes/training.md).
"""

import triton
import triton.language as tl

from twell_compile.kernels.act import gate_part, grads, up_part


@triton.jit
def train_dense_bwd_kernel(g_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, db_ptr, M, N, l1c, l1_ptr,
                           GATED: tl.constexpr, L1: tl.constexpr, L1_DEV: tl.constexpr, BIAS: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, ACT: tl.constexpr):
    if L1_DEV:                                  # the controller's coefficient (fp32 [1])
        l1c = l1c * tl.load(l1_ptr)
    rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cn = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = (rm < M)[:, None] & (cn < N)[None, :]
    offs = rm[:, None] * N + cn[None, :]
    dt = g_ptr.dtype.element_ty
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    hg = tl.where(g < 0.0, 0.0, g)
    a = gate_part(hg, ACT).to(dt).to(tl.float32)              # eager rounds the square
    if GATED:
        u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        h = (a * up_part(u, ACT)).to(dt).to(tl.float32)
    else:
        u = hg
        h = a
    if L1:
        dh += l1c * (tl.where(h > 0.0, 1.0, 0.0) - tl.where(h < 0.0, 1.0, 0.0))
    dg, du = grads(dh, hg, u, GATED, ACT)                     # threshold_backward: NaN passes
    tl.store(dg_ptr + offs, dg.to(dt), mask=ok)
    if GATED:
        tl.store(du_ptr + offs, du.to(dt), mask=ok)
    tl.store(dh_ptr + offs, h.to(dt), mask=ok)
    if BIAS:
        c_ok = cn < N
        tl.atomic_add(db_ptr + cn, tl.sum(tl.where(ok, dg, 0.0), axis=0), mask=c_ok, sem="relaxed")
        if GATED:
            tl.atomic_add(db_ptr + N + cn, tl.sum(tl.where(ok, du, 0.0), axis=0), mask=c_ok, sem="relaxed")
