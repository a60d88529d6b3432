"""Lazy, cached builds of the C++/CUDA sources in ``csrc/`` (ninja via torch.utils.cpp_extension).

Nothing builds at import. ``load(name)`` compiles ``csrc/<name>.*`` on first use and caches the
module (in-process, and on disk under torch's extensions directory, so a second process reuses
it). ``python -m twell_compile.build --check`` compile-checks every source without linking or
running (CI does this where nvcc exists; nothing built here needs a GPU to compile).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

CSRC = Path(__file__).resolve().parent.parent / "csrc"
if not CSRC.is_dir():  # installed (non-editable): csrc ships as package data
    CSRC = Path(__file__).resolve().parent / "csrc"

CXX_FLAGS = ["-O3", "-std=c++17"]
CUDA_FLAGS = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
              "-gencode=arch=compute_80,code=sm_80", "--expt-relaxed-constexpr"]


class BuildError(RuntimeError):
    """A C++/CUDA extension could not be built (no compiler, or a compile error)."""


def sources(name: str) -> list[Path]:
    found = sorted(p for p in CSRC.glob(f"{name}*") if p.suffix in (".cpp", ".cu"))
    if not found:
        raise ValueError(f"no sources for extension {name!r} in {CSRC}")
    return found


@functools.lru_cache(maxsize=None)
def load(name: str, openmp: bool = False) -> ModuleType:
    """Build (once) and import the extension made of ``csrc/<name>*.cpp|.cu``."""
    from torch.utils import cpp_extension

    srcs = sources(name)
    if any(p.suffix == ".cu" for p in srcs) and shutil.which("nvcc") is None and cpp_extension.CUDA_HOME is None:
        raise BuildError(f"extension {name!r} needs nvcc (CUDA toolkit), which was not found")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise BuildError(f"extension {name!r} needs a C++ compiler (c++ or g++), none was found")
    cflags = CXX_FLAGS + (["-fopenmp", "-march=native"] if openmp else [])
    try:
        return cpp_extension.load(
            name=f"twell_{name}", sources=[str(p) for p in srcs], extra_cflags=cflags,
            extra_cuda_cflags=CUDA_FLAGS, extra_ldflags=["-fopenmp"] if openmp else [], verbose=False)
    except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
        raise BuildError(f"building extension {name!r} failed: {e}") from e


def _torch_includes() -> list[str]:
    from torch.utils import cpp_extension

    import torch

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}", abi]


def check(verbose: bool = True) -> int:
    """Compile every source in csrc/ to an object file (no link, no run). Returns failures."""
    import tempfile

    failures = 0
    incs = _torch_includes()
    with tempfile.TemporaryDirectory() as tmp:
        for src in sorted(CSRC.iterdir()):
            if src.suffix == ".cu":
                if shutil.which("nvcc") is None:
                    print(f"skip {src.name} (nvcc not found)")
                    continue
                cmd = ["nvcc", "-c", str(src), "-o", f"{tmp}/{src.stem}.o", *CUDA_FLAGS, *incs, "-Xcompiler", "-fPIC"]
            elif src.suffix == ".cpp":
                cmd = ["c++", "-c", str(src), "-o", f"{tmp}/{src.stem}.o", *CXX_FLAGS, "-fopenmp",
                       "-fPIC", *incs]
            else:
                continue
            r = subprocess.run(cmd, capture_output=True, text=True)
            ok = r.returncode == 0
            failures += not ok
            if verbose:
                print(f"{'ok  ' if ok else 'FAIL'} {src.name}")
                if not ok:
                    print(r.stderr[-4000:])
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="compile-check every csrc/ source")
    args = ap.parse_args(argv)
    if args.check:
        n = check()
        print(f"csrc compile check: {n} failure(s)")
        return 1 if n else 0
    ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
