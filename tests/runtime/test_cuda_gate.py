"""GPU tests of the fused gate GEMM (twell::gate_pack, runtime/cuda_gate.py, csrc/gate_pack*.cu):
g against fp32 under the 2x rule, its packed tiles and counts equal to the oracle's packing of the
kernel's own g (reference.pack_tiles), every configuration, bias, odd M, partial tiles, NaN rows,
tiles over their slots, outputs poisoned first; and the per-row path with it (record gate_cfg)
exact against eager. Skipped where the device is not sm90 or the extension cannot be built."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import twell_compile.ops  # noqa: F401  (the op's schema)
from tests.helpers import ffn_args, ffn_with_biases, poison, rel
from twell_compile.reference import ffn_dense, pack_tiles
from twell_compile.runtime import arch, cuda_gate, cuda_infer

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def built():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused gate GEMM is sm90a")
    return cuda_gate.module()     # a failed build fails here, with the compiler's cause


def test_configuration_table_matches_the_cuda_source():
    """CONFIGS' tile widths are the C++ dispatch's kTileN, in order (read from the source, so the
    CPU suite checks it), and each configuration file's static_assert names the same width."""
    src = (Path(__file__).resolve().parents[2] / "csrc")
    table = re.search(r"kTileN\[\] = \{([^}]*)\}", (src / "gate_pack.cu").read_text())
    assert [int(v) for v in table.group(1).split(",")] == [c.tile_n for c in cuda_gate.CONFIGS]
    for i, c in enumerate(cuda_gate.CONFIGS):
        assert f"kTileN == {c.tile_n}" in (src / f"gate_pack_cfg{i}.cu").read_text()


def test_unusable_on_the_cpu_says_why(caplog):
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.randn(64, 64, dtype=torch.bfloat16)
    assert cuda_gate.unusable(x, w, None) == "not a CUDA tensor"
    cuda_gate.reset_log()
    with caplog.at_level("INFO", logger="twell_compile.runtime.cuda_gate"):
        assert not cuda_gate.runs(x, w, None) and not cuda_gate.runs(x, w, None)
    said = [r.getMessage() for r in caplog.records if "not a CUDA tensor" in r.getMessage()]
    assert len(said) == 1 and "cuBLAS" in said[0]    # once per reason and process


@gpu
def test_configuration_table_matches_the_extension(built):
    mod = cuda_gate.module()
    assert mod.configs() == len(cuda_gate.CONFIGS)
    assert [mod.tile_n(c) for c in range(mod.configs())] == [c.tile_n for c in cuda_gate.CONFIGS]


def _inputs(m, k, n, density, bias, nan_row, dense_rows, seed):
    p = ffn_with_biases(m, k, n, k, density, 0.0, dtype=torch.bfloat16, bias=bias, seed=seed)
    x, w, b = p["x"].contiguous(), p["w_gate"], p["b_gate"]
    if dense_rows:
        x[:dense_rows, 0] = 50.0          # the gate fires on nearly every column of these rows
    if nan_row and m > 2:
        x[m // 2, 1] = float("nan")
    return x, w, b


@gpu
@pytest.mark.parametrize("cfg", range(len(cuda_gate.CONFIGS)))
@pytest.mark.parametrize("m, k, n, density, bias, nan_row, dense_rows", [
    (4096, 2048, 5632, 0.005, False, False, 0),     # the benchmark shape
    (333, 512, 1000, 0.02, True, True, 3),          # odd M, a partial last tile, bias, NaN, full rows
    (1, 256, 256, 0.5, True, False, 0),             # one row, half the columns
    (130, 128, 64, 0.0, False, False, 0),           # nothing fires; N narrower than a tile
])
def test_gate_pack_matches_its_oracle(built, cfg, m, k, n, density, bias, nan_row, dense_rows):
    x, w, b = _inputs(m, k, n, density, bias, nan_row, dense_rows, seed=m + n + cfg)
    slots = 16
    poison()
    g, packed, tcnt = cuda_gate.gate_pack(x, w, b, cfg, slots)
    torch.cuda.synchronize()
    # g: the GEMM, within 2x of eager bf16's error against fp32 (finite rows)
    fin = torch.isfinite(x).all(1)
    ref = F.linear(x[fin].float(), w.float(), None if b is None else b.float())
    eager = F.linear(x[fin], w, b)
    assert rel(g[fin], ref) <= 2 * rel(eager, ref) + 1e-6
    assert torch.isnan(g[~fin]).all()
    # counts and slots: exactly the oracle's packing of the kernel's own g
    want_cnt, want_packed = pack_tiles(g, cuda_gate.CONFIGS[cfg].tile_n, slots)
    assert torch.equal(tcnt, want_cnt)
    valid = torch.arange(slots, device=x.device)[None, None, :] < want_cnt.clamp(max=slots)[..., None]
    assert torch.equal(packed[valid], want_packed[valid])
    if dense_rows:
        assert (tcnt > slots).any()       # tiles over their slots were exercised


@gpu
@pytest.mark.parametrize("cfg", range(len(cuda_gate.CONFIGS)))
@pytest.mark.parametrize("raster, swizzle", [(1, 1), (2, 4)])
def test_tile_order_changes_no_result(built, cfg, raster, swizzle):
    x, w, b = _inputs(2048, 1024, 2048, 0.01, True, False, 0, seed=7)
    g0, p0, c0 = cuda_gate.gate_pack(x, w, b, cfg, 8)
    g1, p1, c1 = cuda_gate.gate_pack(x, w, b, cfg, 8, raster, swizzle)
    assert torch.equal(g0, g1) and torch.equal(c0, c1)
    valid = torch.arange(8, device=x.device)[None, None, :] < c0.clamp(max=8)[..., None]
    assert torch.equal(p0[valid], p1[valid])


@gpu
@pytest.mark.parametrize("cfg", range(len(cuda_gate.CONFIGS)))
def test_g_spills_writes_the_row_tiles_the_slots_cannot_rebuild(built, cfg):
    """g="spills": the same counts and slots as g="all", and g (poisoned first) equal to g="all"'s
    on every row tile over its slots or holding a non-finite value (a NaN row and an Inf row);
    what is left unwritten is never read (the per-row test below)."""
    x, w, b = _inputs(333, 512, 1000, 0.02, True, True, 3, seed=cfg)
    x[7, 2] = float("inf")
    slots = 16
    g_all, p_all, c_all = cuda_gate.gate_pack(x, w, b, cfg, slots)
    poison()
    g, packed, tcnt = cuda_gate.gate_pack(x, w, b, cfg, slots, g="spills")
    torch.cuda.synchronize()
    assert torch.equal(tcnt, c_all)
    valid = torch.arange(slots, device=x.device)[None, None, :] < c_all.clamp(max=slots)[..., None]
    assert torch.equal(packed[valid], p_all[valid])
    tn, t = cuda_gate.CONFIGS[cfg].tile_n, tcnt.shape[1]
    m, n = g_all.shape
    col_tile = torch.arange(n, device=x.device) // tn
    bad = torch.zeros((m, t * tn), dtype=torch.bool, device=x.device)
    bad[:, :n] = ~torch.isfinite(g_all)
    nonfinite = bad.view(m, t, tn).any(2)
    kept = ((tcnt > slots) | nonfinite)[:, col_tile]            # [M, N]: written by the epilogue
    assert kept.any(1)[7] and kept.any(1)[x.shape[0] // 2] and (tcnt > slots).any()
    assert torch.equal(g[kept].view(torch.int16), g_all[kept].view(torch.int16))
    with pytest.raises(RuntimeError, match="g_spills"):
        torch.ops.twell.gate_pack(x, w, b, g, packed[:, :, :0].contiguous(), tcnt, cfg, 0, 1, True)


@gpu
@pytest.mark.parametrize("cfg", [0, 2, 4])
@pytest.mark.parametrize("density, tail, gated, width", [(0.005, 0.0, True, 32), (0.005, 0.5, True, 8),
                                                         (0.2, 0.0, False, 32), (1.0, 0.0, True, 64)])
def test_per_row_path_with_the_fused_gate_is_exact(built, cfg, density, tail, gated, width):
    p = ffn_with_biases(3000, 512, 2048, 384, density, tail, dtype=torch.bfloat16, gated=gated)
    args = ffn_args(p)
    x = args[0]
    x[5, 3] = float("nan")
    x[7, 2] = float("inf")
    with arch.patched(gate_cfg=cfg, gate_slots=16, gate_min_m=0):
        assert cuda_gate.runs(x, args[1], args[2])
        poison()
        y, counts, hsum = cuda_infer.twell_forward(*args, width)
    with arch.patched(gate_cfg=-1):
        y_cublas, counts_cublas, _ = cuda_infer.twell_forward(*args, width)
    eager = ffn_dense(*args)
    assert torch.equal(torch.isnan(y), torch.isnan(eager))
    fin = torch.isfinite(x).all(1)
    ref = ffn_dense(*(None if a is None else a[fin].float() if i == 0 else a.float() for i, a in enumerate(args)))
    assert rel(y[fin], ref) <= 2 * rel(eager[fin], ref) + 1e-6
    # counts are relu(g)'s, g from either GEMM: equal up to the few columns where the two round
    # a value near zero differently
    assert (counts[fin] - counts_cublas[fin]).abs().sum() <= max(8, int(counts_cublas[fin].sum()) // 1000)
    if density >= 0.2:
        assert (counts > width).any()     # the exact tail over g ran


@gpu
def test_the_fused_gate_runs_from_gate_min_m_tokens(built):
    """gate_min_m: calls with fewer tokens take cuBLAS and the compaction pass (no CUTLASS kernel
    launched), calls with as many take twell::gate_pack."""
    from torch.profiler import ProfilerActivity, profile

    p = ffn_with_biases(1024, 512, 2048, 384, 0.01, 0.0, dtype=torch.bfloat16)
    args = ffn_args(p)

    def kernels(m):
        with arch.patched(gate_cfg=4, gate_min_m=1024), profile(activities=[ProfilerActivity.CUDA]) as prof:
            cuda_infer.twell_forward(args[0][:m], *args[1:], 32)
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    fused = [k for k in kernels(1024) if "cutlass" in k.lower()]
    assert fused and not any("compact_rows" in k for k in kernels(1024))
    below = kernels(1023)
    assert not any("cutlass" in k.lower() for k in below) and any("compact_rows" in k for k in below)


@gpu
def test_unusable_names_each_reason(built):
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    assert cuda_gate.unusable(x, w, None) is None
    assert "bfloat16" in cuda_gate.unusable(x.half(), w.half(), None)
    assert "multiples of 8" in cuda_gate.unusable(x[:, :60].contiguous(), w[:, :60].contiguous(), None)
    assert "contiguous" in cuda_gate.unusable(x, w.t(), None)
