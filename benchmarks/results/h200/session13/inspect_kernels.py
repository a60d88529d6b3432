"""Session 13: what Triton makes of the decode pairs kernel's gate loop on this machine
(compiled for the current device; nothing launched): shared memory, registers, spills, and
whether its loads are pipelined (cp.async / TMA in the PTX), for the shipped kernel at M=16
K=2048 and its gate loop alone at several tile sizes and stages.

    python3 benchmarks/results/h200/session13/inspect_kernels.py
"""
import json

import triton
import triton.language as tl
from triton.compiler import ASTSource

from twell_compile.kernels import twell_decode_list
from twell_compile.kernels.twell_decode import _rows_dot

try:
    TARGET = triton.runtime.driver.active.get_current_target()
except RuntimeError:            # no GPU here: compile for the H200's sm_90
    from triton.backends.compiler import GPUTarget
    TARGET = GPUTarget("cuda", 90, 32)


@triton.jit
def gate_loop(x_ptr, w_ptr, y_ptr, K, N, MB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.arange(0, MB)
    acc = _rows_dot(x_ptr + rm[:, None] * K, 1, w_ptr, K, 1, w_ptr, rn < N, rn, rm < 1, K, False, MB, BN, BK)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc)


def info(fn, sig, consts, warps, stages):
    # pointers 16-byte aligned and ints divisible by 16, as the JIT specializes them at these
    # shapes (without these attributes Triton pipelines nothing: run 2's log, void)
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a not in consts}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()}, attrs=attrs)
    ck = triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=stages))
    ptx = ck.asm["ptx"]
    return dict(shared=ck.metadata.shared, regs=getattr(ck, "n_regs", None), spills=getattr(ck, "n_spills", None),
                cp_async=ptx.count("cp.async."), tma=ptx.count("cp.async.bulk.tensor"), mbarrier=ptx.count("mbarrier"),
                mma_sync=ptx.count("mma.sync"), wgmma=ptx.count("wgmma.mma_async"))


k = twell_decode_list.decode_pairs_kernel
ptr = dict(x_ptr="*bf16", wg_ptr="*bf16", bg_ptr="*bf16", wu_ptr="*bf16", bu_ptr="*bf16", ln_ptr="*i32",
           lh_ptr="*fp32", lc_ptr="*i32", rc_ptr="*i32", hs_ptr="*fp32", wdt_ptr="*bf16", acc_ptr="*fp32")
consts = dict(sx_k=1, swg_k=1, swu_k=1, swd_k=1,     # unit strides: the JIT specializes ints equal to 1
              GATED=True, HAS_BG=False, HAS_BU=False, MB=16, BN=32, BK=128, PB=4, KC=2048, UDOT=False, BKU=256,
              ADOWN=True, KOC=2048, PDL=True)
sig = {a: ptr.get(a, "constexpr" if a in consts else "i32") for a in k.arg_names}
print(json.dumps(dict(kernel="decode_pairs_kernel M=16", target=str(TARGET), **info(k, sig, consts, 4, 5))), flush=True)
gsig = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*fp32", K="i32", N="i32", MB="constexpr", BN="constexpr", BK="constexpr")
for mb, bn, bk in ((16, 32, 128), (16, 64, 128), (16, 32, 256), (64, 64, 64)):
    for stages in (1, 3, 5):
        print(json.dumps(dict(kernel=f"gate_loop MB{mb} BN{bn} BK{bk}", stages=stages,
                              **info(gate_loop, gsig, dict(MB=mb, BN=bn, BK=bk), 4, stages))), flush=True)
