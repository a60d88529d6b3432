"""A Triton kernel's SASS for sm_90a without a GPU: its first loop's instruction count and the
instructions that cost there (barriers, shuffles, shared-memory round trips, global loads and
stores, subroutine calls), and its registers per thread.

    python3 benchmarks/probes/sass_loop.py                       # every preset
    python3 benchmarks/probes/sass_loop.py wgrad_dy wgrad_x --set E=1 --warps 2

Triton compiles for the target named here (``GPUTarget("cuda", 90, 32)``) with its bundled
ptxas; its bundled cuobjdump disassembles. Pointers and the integer arguments named in a
preset's ``div16`` get Triton's 16-divisibility attribute, as runtime/launch.py's cached
launches specialise them, so loads vectorise as on the device. A static count, not a timing:
the instructions per step of a loop, not how long a step waits. It found the wgrad passes'
64-bit division routine (84 instructions, called once per entry; tests/kernels/test_twell_train.py
keeps it out). Needs Triton >= 3.7 (the constexpr keys of ASTSource).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):                  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

WATCH = ("BAR", "SHFL", "STS", "LDS", "LDG", "LDGSTS", "STG", "ATOMG", "RED", "CALL")


def _wgrad(dy: bool) -> dict[str, Any]:
    from twell_compile.kernels.twell_train_wgrad import wgrad_kernel

    return dict(fn=wgrad_kernel, warps=4,
                consts=dict(GATED=True, HAS_BG=False, HAS_BU=False, L1=False, L1_DEV=False, DY=dy, BKW=2048, E=4,
                            ACT=0, WP=256),
                bf16={"ellg_ptr", "ellu_ptr", "x_ptr", "dy_ptr", "wg_ptr", "bgate_ptr", "wu_ptr", "bup_ptr", "wdt_ptr"},
                f32={"eg_ptr", "eu_ptr", "l1_ptr", "dwg_ptr", "dwu_ptr", "dwd_ptr", "dbg_ptr", "dbu_ptr", "l1c"},
                div16={"sx_m", "sdy_m", "swg_n", "swu_n", "swd_n", "K", "KO", "W"})


def _rows() -> dict[str, Any]:
    from twell_compile.kernels.twell_rows import twell_rows_kernel

    return dict(fn=twell_rows_kernel, warps=2, stages=4,
                consts=dict(GATED=True, HAS_BU=False, HAS_BD=False, K_P=2048, KO_P=2048, PAIRS=1, CH=256, PF=3,
                            STAGES=4, NB=8, ACT=0, PDL=True, SPLIT=1, SEG=48, sx_k=1, swu_k=1, swd_k=1, sy_k=1),
                bf16={"x_ptr", "g_ptr", "wu_ptr", "bu_ptr", "wdt_ptr", "bd_ptr", "y_ptr"}, f32={"hsum_ptr", "part_ptr"},
                div16={"sx_m", "sg_m", "swu_n", "swd_n", "sy_m", "K", "N", "KO", "W"})


def _dx() -> dict[str, Any]:
    from twell_compile.kernels.twell_train_bwd import dx_rows_kernel

    return dict(fn=dx_rows_kernel, warps=4, consts=dict(GATED=True, K_P=2048, PAIRS=4),
                bf16={"wg_ptr", "wu_ptr", "dx_ptr"}, f32={"eg_ptr", "eu_ptr"},
                div16={"W", "swg_n", "swu_n", "sdx_m", "K"})


def _union2(up: bool) -> dict[str, Any]:
    """The union2 decode form's up or down launch at 64 rows (the H200 record's fields there)."""
    from twell_compile.kernels.twell_decode_union2 import decode_union2_down_kernel, decode_union2_up_kernel

    if up:
        return dict(fn=decode_union2_up_kernel, warps=4, stages=3,
                    consts=dict(GATED=True, HAS_BU=False, DENSE_UP=False, UP_DOT=True, BL=64, NBP=128, C=32, BK=128,
                                MT=32, NT=2, SK=4, PDL=True, ACT=0, sx_k=1, swu_k=1),
                    bf16={"x_ptr", "wu_ptr", "bu_ptr", "g_ptr", "u_ptr", "h_ptr"}, f32={"hsa_ptr", "part_ptr"},
                    div16={"sx_m", "swu_n", "K", "N", "KS"})
    return dict(fn=decode_union2_down_kernel, warps=4, stages=2,
                consts=dict(DIRECT=False, HAS_BD=False, HAS_ST=True, NBP=128, BO=128, CD=128, MT=32, NT=2, CB=64,
                            PDL=True, swd_k=1, sy_k=1),
                bf16={"h_ptr", "wdt_ptr", "bd_ptr", "y_ptr"}, f32={"acc_ptr", "hsa_ptr", "hsum_ptr", "st_ptr"},
                div16={"swd_n", "sy_m", "N", "KO"})


# each the record's launch at K = K_out = 2048 (runtime/arch.py H200)
PRESETS: dict[str, Callable[[], dict[str, Any]]] = {
    "wgrad_dy": lambda: _wgrad(True), "wgrad_x": lambda: _wgrad(False), "rows": _rows, "dx_rows": _dx,
    "union2_up": lambda: _union2(True), "union2_down": lambda: _union2(False),
}


def tools() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_sass(p: dict[str, Any]) -> tuple[str, int, int]:
    """(SASS text, registers per thread, bytes of stack and local memory per thread: spills) of
    preset ``p`` compiled for sm_90a (``p["maxnreg"]``: ptxas's register cap, as the launcher's)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, consts = p["fn"], p["consts"]
    if not isinstance(fn, triton.runtime.JITFunction):
        raise RuntimeError(f"{fn.__name__} is not a JIT function here ({type(fn).__name__}): unset TRITON_INTERPRET")
    names = fn.arg_names
    unknown = sorted(set(consts) - set(names))
    if unknown:
        raise ValueError(f"--set: {unknown} are not arguments of {fn.__name__} ({', '.join(names)})")
    sig = {}
    for a in names:
        if a in consts:
            sig[a] = "constexpr"
        elif a.endswith("_ptr"):
            sig[a] = "*bf16" if a in p["bf16"] else "*fp32" if a in p["f32"] else "*i32"
        else:
            sig[a] = "fp32" if a in p["f32"] else "i32"
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names
             if sig[a] != "constexpr" and (a.endswith("_ptr") or a in p["div16"])}
    src = ASTSource(fn, sig, constexprs={(names.index(a),): v for a, v in consts.items()}, attrs=attrs)
    opts = dict(num_warps=p["warps"], num_stages=p.get("stages", 1))
    if p.get("maxnreg"):
        opts["maxnreg"] = p["maxnreg"]
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        run = [str(tools() / "cuobjdump"), str(cubin)]
        sass = subprocess.run(run[:1] + ["-sass"] + run[1:], capture_output=True, text=True, check=True).stdout
        res = subprocess.run(run[:1] + ["-res-usage"] + run[1:], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    spill = sum(int(v) for v in re.findall(r"(?:STACK|LOCAL):(\d+)", res))
    return sass, int(regs.group(1)) if regs else -1, spill


def first_loop(sass: str) -> dict[str, Any]:
    """The first backward branch's body: its instruction count and the WATCH instructions in it
    (opcode before the first '.'); whole-kernel counts of the same beside them."""
    ins = [(int(m.group(1), 16), m.group(2)) for ln in sass.splitlines()
           for m in [re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(.*)", ln)] if m]

    def op(text: str) -> str:
        return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]

    back = [(int(m.group(1), 16), a) for a, t in ins for m in [re.search(r"\bBRA (0x[0-9a-f]+)", t)]
            if m and int(m.group(1), 16) < a]
    lo, hi = back[0] if back else (0, -1)
    body = Counter(op(t) for a, t in ins if lo <= a <= hi)
    whole = Counter(op(t) for _, t in ins)
    return dict(loop_instructions=sum(body.values()), instructions=len(ins),
                loop={w: body[w] for w in WATCH if body[w]}, kernel={w: whole[w] for w in WATCH if whole[w]})


def _value(v: str) -> Any:
    return {"True": True, "False": False}.get(v, int(v) if re.fullmatch(r"-?\d+", v) else v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("presets", nargs="*", default=list(PRESETS), help=f"of {', '.join(PRESETS)}")
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE", help="constexprs to change")
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--maxnreg", type=int, default=0, help="ptxas's register cap (0: none), as a record's *_maxnreg")
    a = ap.parse_args(argv)
    bad = [n for n in a.presets if n not in PRESETS]
    if bad:
        raise ValueError(f"presets {bad}: choose from {', '.join(PRESETS)}")
    changes = {}
    for kv in a.set:
        if "=" not in kv:
            raise ValueError(f"--set {kv!r}: write NAME=VALUE, e.g. E=1")
        k, v = kv.split("=", 1)
        changes[k] = _value(v)
    import triton

    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7):
        raise SystemExit(f"sass_loop.py needs Triton >= 3.7 (ASTSource's constexpr keys), found {triton.__version__}")
    if not (tools() / "cuobjdump").exists():
        raise SystemExit(f"no cuobjdump in {tools()}: this Triton carries no NVIDIA tools")
    for name in a.presets:
        p = PRESETS[name]()
        p["consts"] = {**p["consts"], **changes}
        if a.warps:
            p["warps"] = a.warps
        p["maxnreg"] = a.maxnreg
        sass, regs, spill = compile_sass(p)
        s = first_loop(sass)
        print(f"{name} ({p['fn'].__name__}, {p['warps']} warps): {regs} registers, {spill} bytes of stack and local "
              f"memory, {s['instructions']} instructions; "
              f"first loop {s['loop_instructions']}: {s['loop']}; kernel: {s['kernel']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
