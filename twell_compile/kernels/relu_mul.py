"""Triton device code: h = relu(g) * u in one pass (the dense path's elementwise step).

Eager runs relu and mul as two passes over [M, N] (0.5 ms extra at M=65536, N=5632, bf16 on
H200: the dense path then trailed Inductor, which fuses them, by 10%). Bit-identical to eager:
relu is exact, the product is taken in fp32 and rounded once, as eager's mul does. NaN in g
survives relu (NaN < 0 is false), as in torch.relu. ACT (kernels/act.py) forms h of squared
ReLU (relu(g)^2 rounded to the dtype, then the product: eager's two roundings) or dReLU
(relu(g) * relu(u)); the count is of relu(g) whatever the activation.
"""

import triton
import triton.language as tl

from twell_compile.kernels.act import gate_part, up_part


@triton.jit
def relu_mul_rows_kernel(g_ptr, u_ptr, h_ptr, cnt_ptr, asum_ptr, n, span, stride_g, stride_u, stride_h,
                         GATED: tl.constexpr, ATOMIC: tl.constexpr, BLOCK: tl.constexpr,
                         ACT: tl.constexpr):
    """Grid (rows, column spans): h = relu(g) * u (GATED) or relu(g) over columns
    [pid1 * span, pid1 * span + span) of one row, plus that span's count of relu(g) != 0 (NaN
    included) and sum of |h| in fp32: stored (one span per row) or atomically added (ATOMIC,
    into zeroed buffers).

    The counts and sums are what the statistics and the density probe need; taking them here
    saves the two extra passes over [M, N] they cost otherwise (~1 ms per layer at 16384 tokens,
    N=5632: docs/design-notes/host.md). Spans keep small M parallel. One row per program, 1024
    columns at a time (arch's dense_block). h is bit-identical to eager.
    """
    row = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * span
    cols = tl.arange(0, BLOCK)
    cnt = tl.zeros([BLOCK], dtype=tl.int32)
    asum = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(lo, tl.minimum(lo + span, n), BLOCK):
        c = start + cols
        ok = c < n
        g = tl.load(g_ptr + row * stride_g + c, mask=ok, other=0.0).to(tl.float32)
        hg = tl.where(g < 0.0, 0.0, g)
        a = gate_part(hg, ACT).to(h_ptr.dtype.element_ty).to(tl.float32)      # eager rounds the square
        if GATED:
            u = tl.load(u_ptr + row * stride_u + c, mask=ok, other=0.0).to(tl.float32)
            h = (a * up_part(u, ACT)).to(h_ptr.dtype.element_ty)
        else:
            h = a.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + c, h, mask=ok)
        cnt += ((g > 0.0) | (g != g)).to(tl.int32)
        asum += tl.abs(h.to(tl.float32))
    if ATOMIC:
        tl.atomic_add(cnt_ptr + row, tl.sum(cnt, axis=0), sem="relaxed")
        tl.atomic_add(asum_ptr + row, tl.sum(asum, axis=0), sem="relaxed")
    else:
        tl.store(cnt_ptr + row, tl.sum(cnt, axis=0))
        tl.store(asum_ptr + row, tl.sum(asum, axis=0))
