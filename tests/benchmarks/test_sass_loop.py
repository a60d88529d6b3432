"""benchmarks/probes/sass_loop.py: a kernel's SASS for sm_90a compiled here (no GPU), its first
loop's instructions counted."""

from __future__ import annotations

import os

import pytest

from benchmarks.probes import sass_loop

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/              @!P0 BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0040*/                   SHFL.BFLY PT, R5, R4, 0x1, 0x1f ;
        /*0050*/                   CALL.REL.NOINC 0x90 ;
        /*0060*/               @P1 BRA 0x20 ;
        /*0070*/                   STG.E [R2.64], R5 ;
        /*0080*/                   EXIT ;
        /*0090*/                   RET.REL.NODEC R20 0x0 ;
"""


def test_first_loop_counts_the_backward_branchs_body():
    s = sass_loop.first_loop(SASS)
    assert s["instructions"] == 10 and s["loop_instructions"] == 5          # 0x20 .. 0x60
    assert s["loop"] == {"BAR": 1, "SHFL": 1, "LDG": 1, "CALL": 1}          # predicated ones too
    assert s["kernel"] == {"BAR": 1, "SHFL": 1, "LDG": 1, "STG": 1, "CALL": 1}


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="choose from"):
        sass_loop.main(["no_such_kernel"])
    with pytest.raises(ValueError, match="NAME=VALUE"):
        sass_loop.main(["dx_rows", "--set", "PAIRS"])


def test_a_preset_compiles_for_sm90a_here(capsys):
    triton = pytest.importorskip("triton")
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip("ASTSource's constexpr keys differ before Triton 3.7")
    if not (sass_loop.tools() / "cuobjdump").exists():
        pytest.skip("this Triton carries no cuobjdump")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: the kernels are interpreted here, nothing compiles")
    with pytest.raises(ValueError, match="not arguments of dx_rows_kernel"):
        sass_loop.main(["dx_rows", "--set", "NO_SUCH=1"])
    sass_loop.main(["dx_rows", "--set", "PAIRS=2"])
    out = capsys.readouterr().out
    assert out.startswith("dx_rows (dx_rows_kernel, 4 warps): ")
    assert "'LDG'" in out and "CALL" not in out                 # its gathers, and no division routine


def _needs_the_compiler() -> None:
    """Skip unless Triton >= 3.7 with its cuobjdump compiles kernels here (not interpreted)."""
    triton = pytest.importorskip("triton")
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7) or not (sass_loop.tools() / "cuobjdump").exists():
        pytest.skip("needs Triton >= 3.7 with its cuobjdump")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: the kernels are interpreted here, nothing compiles")


def test_the_register_cap_is_ptxas_s_and_spills_are_counted(capsys):
    """--maxnreg compiles as the launcher's maxnreg does: the DY pass at 128 registers (164
    uncapped) with nothing spilled, at 96 with stack or local memory."""
    _needs_the_compiler()
    _, free, free_spill = sass_loop.compile_sass(sass_loop.PRESETS["wgrad_dy"]())
    _, capped, capped_spill = sass_loop.compile_sass({**sass_loop.PRESETS["wgrad_dy"](), "maxnreg": 128})
    _, tight, tight_spill = sass_loop.compile_sass({**sass_loop.PRESETS["wgrad_dy"](), "maxnreg": 96})
    assert free > 128 and capped <= 128 and tight <= 96
    assert free_spill == capped_spill == 0 and tight_spill > 0
    sass_loop.main(["wgrad_x", "--maxnreg", "96"])
    assert "wgrad_x (wgrad_kernel, 4 warps): 96 registers, " in capsys.readouterr().out


def test_the_union2_presets_compile_with_their_gathers_in_the_loop(capsys):
    """union2_up's K loop copies its gathered W_up tile and x tiles asynchronously (LDGSTS);
    union2_down's loop gathers its W_d^T rows with plain loads (LDG); nothing spills."""
    _needs_the_compiler()
    up_sass, _, up_spill = sass_loop.compile_sass(sass_loop.PRESETS["union2_up"]())
    down_sass, _, down_spill = sass_loop.compile_sass(sass_loop.PRESETS["union2_down"]())
    assert up_spill == 0 and down_spill == 0
    assert sass_loop.first_loop(up_sass)["loop"].get("LDGSTS", 0) > 0
    assert sass_loop.first_loop(down_sass)["loop"].get("LDG", 0) > 0
