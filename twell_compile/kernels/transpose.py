"""Triton device code: out[c, r] = w[r, c] for a 2-D tensor, 64 x 64 tiles (loads and stores
both coalesced; ``transpose_tile`` also runs inside the compaction's launch, twell_rows.py).
``w.t().contiguous()`` ran PyTorch's generic strided copy: 77 us for a
[2048, 5632] bf16 weight on the H200 (3 per sparse training step, bench_ffn_train --parts)."""

import triton
import triton.language as tl

from twell_compile.kernels.pdl import pdl_enter


@triton.jit
def transpose_tile(src_ptr, dst_ptr, R, C, s_r, s_c, tr, tc, BR: tl.constexpr, BC: tl.constexpr):
    """Tile (tr, tc) of out[c, r] = w[r, c] (out contiguous [C, R])."""
    r = tr.to(tl.int64) * BR + tl.arange(0, BR)
    c = tc.to(tl.int64) * BC + tl.arange(0, BC)
    ok = (r < R)[:, None] & (c < C)[None, :]
    t = tl.load(src_ptr + r[:, None] * s_r + c[None, :] * s_c, mask=ok)
    tl.store(dst_ptr + c[None, :] * R + r[:, None], t, mask=ok)


@triton.jit
def transpose_tile_at(src_ptr, dst_ptr, R, C, s_r, s_c, t, B: tl.constexpr):
    """Tile t of the B x B tiles in row-major order: the programs a launch adds after its own
    work write out = w^T this way (the compaction's and the merge's, twell_rows.py)."""
    tiles_c = tl.cdiv(C, B)
    transpose_tile(src_ptr, dst_ptr, R, C, s_r, s_c, t // tiles_c, t % tiles_c, B, B)


@triton.jit
def transpose_kernel(src_ptr, dst_ptr, R, C, s_r, s_c, BR: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    transpose_tile(src_ptr, dst_ptr, R, C, s_r, s_c, tl.program_id(0), tl.program_id(1), BR, BC)
