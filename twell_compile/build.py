"""Lazy, cached builds of the C++/CUDA sources in ``csrc/`` (ninja via torch.utils.cpp_extension).

Nothing builds at import. ``load(name)`` compiles ``csrc/<name>.*`` on first use and caches the
module (in-process, and on disk, so a second process reuses it). The disk cache is one
directory per extension under torch's extensions root (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), named by ``build_dir_name``: package version, torch and Python
versions and a hash of the checkout's ``csrc`` path and flags, so two checkouts or versions
never rebuild each other's cache. A build prints one line to stderr before and one with its time
after, and ``built_this_run()`` keeps its time; loading a cached build prints nothing. A build that
cannot run (no C++ compiler) or fails raises ``BuildError`` with one line: what went wrong and
what to do; the compiler's full log goes to the ``twell_compile`` logger at DEBUG level.
``python -m twell_compile.build --check`` compile-checks every source without linking or
running (CI does this where nvcc exists; nothing built here needs a GPU to compile), and the
measurement probes of a checkout's ``benchmarks/probes/`` (not shipped; ``load(name,
directory=PROBES)`` builds one).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType
from typing import Optional, Sequence

CSRC = Path(__file__).resolve().parent.parent / "csrc"
if not CSRC.is_dir():  # installed (non-editable): csrc ships as package data
    CSRC = Path(__file__).resolve().parent / "csrc"
# benchmark probes (benchmarks/probes/*.cu): in a checkout only, never shipped or used by the ops
PROBES = Path(__file__).resolve().parent.parent / "benchmarks" / "probes"

log = logging.getLogger(__name__)

# No -std here: torch.utils.cpp_extension passes the one its headers need (C++17 up to torch
# 2.13, C++20 from 2.14, whose headers refuse C++17); ``check`` adds ``std_flag()`` itself.
CXX_FLAGS = ["-O3"]
CUDA_FLAGS = ["-O3", "-gencode=arch=compute_90a,code=sm_90a",
              "-gencode=arch=compute_80,code=sm_80", "--expt-relaxed-constexpr"]
# Extensions built on CUTLASS's headers: Hopper only (wgmma, TMA), and NDEBUG, without which
# CuTe's device asserts put a call into the mainloop and ptxas serializes its wgmma (C7510).
CUTLASS_EXTENSIONS = ("gate_pack", "cutlass_gemm")
CUTLASS_CUDA_FLAGS = ["-O3", "-DNDEBUG", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr"]
CUTLASS_PIN = "nvidia-cutlass==4.2.0.0"


def cutlass_includes() -> list[str]:
    """CUTLASS's C++ include directories: ``$CUTLASS_PATH`` (a CUTLASS checkout) where set, else
    the headers the ``nvidia-cutlass`` wheel ships (its ``cutlass_library/source``). Raises
    ``BuildError`` naming the fix when neither is there."""
    root = os.environ.get("CUTLASS_PATH")
    if root:
        base = Path(root)
    else:
        import importlib.util

        spec = importlib.util.find_spec("cutlass_library")
        if spec is None or spec.origin is None:
            raise BuildError(f"the fused CUDA kernels need CUTLASS's headers: pip install {CUTLASS_PIN} "
                             f"(or set CUTLASS_PATH to a CUTLASS checkout)")
        base = Path(spec.origin).parent / "source"
    dirs = [base / "include", base / "tools" / "util" / "include"]
    if not (dirs[0] / "cutlass" / "cutlass.h").is_file():
        raise BuildError(f"no CUTLASS headers under {base} (cutlass/cutlass.h missing): pip install {CUTLASS_PIN} "
                         f"or set CUTLASS_PATH to a CUTLASS checkout")
    return [str(d) for d in dirs]


def cuda_flags(name: str) -> list[str]:
    """nvcc flags of extension ``name``: CUTLASS's include directories and Hopper-only code for
    the CUTLASS extensions, the default flags for the others."""
    if name in CUTLASS_EXTENSIONS:
        return CUTLASS_CUDA_FLAGS + [f"-I{d}" for d in cutlass_includes()]
    return list(CUDA_FLAGS)


def std_flag() -> str:
    """The C++ standard the installed torch's headers need: C++20 from torch 2.14, else C++17."""
    import torch

    major, minor = (int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 14) else "-std=c++17"


class BuildError(RuntimeError):
    """A C++/CUDA extension could not be built (no compiler, or a compile error); the message is
    one line."""


# Extensions built (not loaded from the disk cache) by this process: module -> seconds.
_built: dict[str, float] = {}


def built_this_run() -> dict[str, float]:
    """The extensions this process built, with each build's time in seconds (e.g.
    ``{"twell_cpu_ffn": 41.3}``); empty when every one came from the disk cache or none loaded."""
    return dict(_built)


def cxx_compiler() -> str:
    """The C++ compiler torch.utils.cpp_extension builds with: ``$CXX``, else ``c++``."""
    from torch.utils import cpp_extension

    return cpp_extension.get_cxx_compiler()


def missing_compiler() -> Optional[str]:
    """Why the C++ compiler that a build would run is not there (one line, with the fix), or
    None when it is on PATH."""
    cxx = cxx_compiler()
    program = cxx.split()[0] if cxx.strip() else "c++"
    if shutil.which(program) is not None:
        return None
    chosen = f"$CXX={cxx!r}" if os.environ.get("CXX") else "c++ ($CXX unset)"
    other = next((c for c in ("g++", "clang++") if c != program and shutil.which(c)), None)
    fix = (f"{other} is on PATH: set CXX={other}" if other else
           "install a C++ compiler, e.g. g++ (Debian/Ubuntu: apt-get install g++)")
    return f"no C++ compiler: torch builds extensions with {chosen}, which is not on PATH; {fix}"


# The line of a failed build's log that says what went wrong: a compiler diagnostic, a missing
# program or file, a link error.
_CAUSE = re.compile(r"\berror\b:|: not found|No such file|cannot find|undefined reference|command not found",
                    re.IGNORECASE)


def failure_reason(log_text: str) -> str:
    """The first line of a failed build's log that names the cause (else its last line, ninja's
    "build stopped"), at most 300 characters."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    cause = next((ln for ln in lines if _CAUSE.search(ln) and not ln.startswith(("[", "FAILED:"))),
                 lines[-1] if lines else "no output")
    return cause if len(cause) <= 300 else cause[:297] + "..."


def sources(name: str, directory: Path | str = CSRC) -> list[Path]:
    """The .cpp/.cu files of extension ``name`` in ``directory`` (csrc/ unless told)."""
    directory = Path(directory)
    found = sorted(p for p in directory.glob(f"{name}*") if p.suffix in (".cpp", ".cu"))
    if not found:
        raise ValueError(f"no sources for extension {name!r} in {directory}")
    return found


def build_dir_name(name: str, *, version: str, torch_version: str, python: str, csrc: Path | str,
                   flags: Sequence[str]) -> str:
    """Directory name of one extension's build, e.g.
    ``twell_cpu_ffn-0.1.0-torch2.13.0_cpu-py311-3f2a9c1d0b7e``: the 12-hex hash (sha256) covers
    the absolute ``csrc`` path and the compile flags. Another checkout, version or flag set gets
    its own directory; an edit inside one checkout is rebuilt in place (ninja tracks sources)."""
    clean = lambda v: re.sub(r"[^A-Za-z0-9._]", "_", v)  # noqa: E731  ("2.13.0+cpu" -> "2.13.0_cpu")
    digest = hashlib.sha256("\0".join([str(Path(csrc).resolve()), *flags]).encode()).hexdigest()[:12]
    return f"twell_{clean(name)}-{clean(version)}-torch{clean(torch_version)}-{clean(python)}-{digest}"


def build_directory(name: str, flags: Sequence[str], source_dir: Path | str = CSRC) -> Path:
    """Where ``load`` builds extension ``name`` from ``source_dir``: ``build_dir_name`` under
    ``TORCH_EXTENSIONS_DIR`` (torch's default root when unset)."""
    import torch
    from torch.utils import cpp_extension

    from twell_compile import __version__

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(root) / build_dir_name(name, version=__version__, torch_version=torch.__version__, python=python,
                                       csrc=source_dir, flags=flags)


def is_built(module: str, directory: Path, srcs: Sequence[Path]) -> bool:
    """Whether ``directory`` holds ``module``'s library, newer than every source and every header
    beside the sources."""
    from torch.utils import cpp_extension

    lib = directory / f"{module}{cpp_extension.LIB_EXT}"
    if not lib.is_file():
        return False
    deps = list(srcs) + [p for d in {Path(s).parent for s in srcs} for p in d.iterdir() if p.suffix in (".h", ".cuh")]
    return all(lib.stat().st_mtime >= p.stat().st_mtime for p in deps)


def build(module: str, srcs: Sequence[Path], directory: Path, cflags: Sequence[str],
          ldflags: Sequence[str] = (), cuda_cflags: Sequence[str] = tuple(CUDA_FLAGS)) -> ModuleType:
    """Build (if not built yet) and import ``module`` from ``srcs`` in ``directory``.

    A build prints "twell: building ..." to stderr before and "twell: built <module> in 41.3 s"
    after (the user would otherwise wait in silence) and records its time (``built_this_run``);
    a cached one prints nothing. A failure raises ``BuildError`` with the log's cause line; the
    whole log goes to the logger at DEBUG level.
    """
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    building = not is_built(module, directory, srcs)
    if building:
        kind = "CUDA" if any(p.suffix == ".cu" for p in srcs) else "CPU"
        print(f"twell: building the {kind} kernels {module} (first use only, up to a minute on 2 cores) "
              f"in {directory} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        mod = cpp_extension.load(
            name=module, sources=[str(p) for p in srcs], extra_cflags=list(cflags),
            extra_cuda_cflags=list(cuda_cflags), extra_ldflags=list(ldflags), build_directory=str(directory),
            verbose=False)
    except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
        log.debug("twell: building %s in %s failed; its log:\n%s", module, directory, e)
        raise BuildError(f"building extension {module!r} failed: {failure_reason(str(e))} (the full log: the "
                         f"'twell_compile' logger at DEBUG level)") from None
    if building:
        _built[module] = time.perf_counter() - start
        print(f"twell: built {module} in {_built[module]:.1f} s", file=sys.stderr, flush=True)
    return mod


@functools.lru_cache(maxsize=None)
def load(name: str, openmp: bool = False, directory: Path | str | None = None) -> ModuleType:
    """Build (once) and import the extension made of ``<directory>/<name>*.cpp|.cu`` (directory:
    csrc/ unless told, e.g. ``PROBES`` for a benchmark probe)."""
    from torch.utils import cpp_extension

    source_dir = CSRC if directory is None else Path(directory)
    srcs = sources(name, source_dir)
    if any(p.suffix == ".cu" for p in srcs) and shutil.which("nvcc") is None and cpp_extension.CUDA_HOME is None:
        raise BuildError(f"extension {name!r} needs nvcc (CUDA toolkit), which was not found")
    missing = missing_compiler()
    if missing is not None:
        raise BuildError(f"extension {name!r}: {missing}")
    cflags = CXX_FLAGS + (["-fopenmp", "-march=native"] if openmp else [])
    ldflags = ["-fopenmp"] if openmp else []
    nvcc = cuda_flags(name)
    target = build_directory(name, cflags + nvcc + ldflags, source_dir)
    return build(f"twell_{name}", srcs, target, cflags, ldflags, nvcc)


def _torch_includes() -> list[str]:
    from torch.utils import cpp_extension

    import torch

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}", abi]


def check(verbose: bool = True, jobs: Optional[int] = None) -> int:
    """Compile every source in csrc/ (and the checkout's benchmarks/probes/) to an object file
    (no link, no run), ``jobs`` compilers at a time (default: one per CPU). Returns failures."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    failures = 0
    incs = _torch_includes()
    srcs = sorted(CSRC.iterdir()) + (sorted(PROBES.iterdir()) if PROBES.is_dir() else [])
    with tempfile.TemporaryDirectory() as tmp:
        cmds = []
        for src in srcs:
            if src.suffix == ".cu":
                if shutil.which("nvcc") is None:
                    print(f"skip {src.name} (nvcc not found)")
                    continue
                try:
                    nvcc = cuda_flags(next((e for e in CUTLASS_EXTENSIONS if src.stem.startswith(e)), src.stem))
                except BuildError as e:
                    print(f"FAIL {src.name}: {e}")
                    failures += 1
                    continue
                cmds.append((src, ["nvcc", "-c", str(src), "-o", f"{tmp}/{src.stem}.o", *nvcc, std_flag(), *incs,
                                   "-Xcompiler", "-fPIC"]))
            elif src.suffix == ".cpp":
                cmds.append((src, ["c++", "-c", str(src), "-o", f"{tmp}/{src.stem}.o", *CXX_FLAGS, std_flag(),
                                   "-fopenmp", "-fPIC", *incs]))
        with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
            results = list(pool.map(lambda sc: (sc[0], subprocess.run(sc[1], capture_output=True, text=True)), cmds))
        for src, r in results:
            ok = r.returncode == 0
            failures += not ok
            if verbose:
                print(f"{'ok  ' if ok else 'FAIL'} {src.name}")
                if not ok:
                    print(r.stderr[-4000:])
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true",
                    help="compile-check every csrc/ source and the checkout's benchmarks/probes/")
    args = ap.parse_args(argv)
    if args.check:
        n = check()
        print(f"compile check (csrc/, benchmarks/probes/): {n} failure(s)")
        return 1 if n else 0
    ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
