"""build.py: a build says so on stderr (before, and its time after) and keeps its time; the cache
directory is per package version, torch and Python version, checkout and flags; a build that
cannot run or fails is reported in one line, its log at DEBUG level."""

import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import twell_compile
from twell_compile import build

ARGS = dict(version="0.1.0", torch_version="2.13.0+cpu", python="py311", flags=["-O3", "-fopenmp"])


def test_build_dir_name_carries_versions_and_a_hash_of_checkout_and_flags(tmp_path):
    a, b = tmp_path / "a" / "csrc", tmp_path / "b" / "csrc"
    name = build.build_dir_name("cpu_ffn", csrc=a, **ARGS)
    assert re.fullmatch(r"twell_cpu_ffn-0\.1\.0-torch2\.13\.0_cpu-py311-[0-9a-f]{12}", name), name
    assert build.build_dir_name("cpu_ffn", csrc=a, **ARGS) == name                       # a pure function
    assert build.build_dir_name("cpu_ffn", csrc=b, **ARGS) != name                       # another checkout
    assert build.build_dir_name("cpu_ffn", csrc=a, **{**ARGS, "version": "0.2.0"}) != name
    assert build.build_dir_name("cpu_ffn", csrc=a, **{**ARGS, "torch_version": "2.11.0"}) != name
    assert build.build_dir_name("cpu_ffn", csrc=a, **{**ARGS, "flags": ["-O3"]}) != name


def test_load_builds_under_torch_extensions_dir_and_says_so(tmp_path, monkeypatch, capsys):
    """cpp_extension.load stubbed: what load asks for, and the two stderr lines around it."""
    from torch.utils import cpp_extension

    asked = {}
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: asked.update(kw) or "module")
    assert build.load.__wrapped__("cpu_ffn", openmp=True) == "module"
    (directory,) = tmp_path.iterdir()
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert directory.name.startswith(
        f"twell_cpu_ffn-{twell_compile.__version__}-torch{torch.__version__.replace('+', '_')}-{tag}"), directory.name
    assert asked["build_directory"] == str(directory) and directory.is_dir()
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"twell: building the CPU kernels twell_cpu_ffn (first use only, up to a minute on 2 cores) "
                      f"in {directory} ...")
    assert re.fullmatch(r"twell: built twell_cpu_ffn in \d+\.\d s", err[1]), err


TINY = """
#include <Python.h>
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "twell_build_probe", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit_twell_build_probe(void) { return PyModule_Create(&def); }
"""


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="needs a C++ compiler")
def test_a_real_build_prints_its_time_and_a_cached_one_prints_nothing(tmp_path, capsys):
    src = tmp_path / "probe.cpp"
    src.write_text(TINY)
    out = tmp_path / "build"
    mod = build.build("twell_build_probe", [src], out, ["-O1"])
    assert mod.__name__ == "twell_build_probe"
    err = capsys.readouterr().err
    assert "twell: building the CPU kernels twell_build_probe (first use only, up to a minute on 2 cores)" in err
    took = re.search(r"twell: built twell_build_probe in (\d+\.\d) s", err)
    assert took and f"{build.built_this_run()['twell_build_probe']:.1f}" == took.group(1)
    assert build.is_built("twell_build_probe", out, [src])
    build.build("twell_build_probe", [src], out, ["-O1"])
    assert "twell:" not in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_a_failed_build_is_one_line_and_its_log_is_at_debug_level(tmp_path, caplog):
    src = tmp_path / "broken.cpp"
    src.write_text("this is not C++\n")
    with caplog.at_level(logging.DEBUG, logger="twell_compile"), pytest.raises(build.BuildError) as e:
        build.build("twell_broken", [src], tmp_path / "build", ["-O1"])
    message = str(e.value)
    assert "\n" not in message and e.value.__cause__ is None and e.value.__suppress_context__
    assert re.fullmatch(r"building extension 'twell_broken' failed: \S*broken\.cpp:1:1: error: .* \(the full log: "
                        r"the 'twell_compile' logger at DEBUG level\)", message), message
    (record,) = [r for r in caplog.records if r.name == "twell_compile.build"]
    assert record.levelno == logging.DEBUG and "ninja" in record.getMessage() and str(tmp_path) in record.getMessage()
    assert "twell_broken" not in build.built_this_run()


@pytest.mark.parametrize("log_text,cause", [
    ("Error building extension 'x': [1/2] cxx -c a.cpp\nFAILED: a.o\ncxx -c a.cpp\n/bin/sh: 1: cxx: not found\n"
     "ninja: build stopped: subcommand failed.", "/bin/sh: 1: cxx: not found"),
    ("[1/2] c++ -c a.cpp\nIn file included from a.cpp:1:\n/x/a.h:3:10: fatal error: Python.h: No such file or "
     "directory\ncompilation terminated.", "/x/a.h:3:10: fatal error: Python.h: No such file or directory"),
    ("[2/2] c++ a.o -o a.so\n/usr/bin/ld: cannot find -lgomp\nninja: build stopped.", "/usr/bin/ld: cannot find -lgomp"),
    ("Error building extension 'x': [1/2] false -c a.cpp\nFAILED: a.o\nninja: build stopped: subcommand failed.",
     "ninja: build stopped: subcommand failed."),
])
def test_failure_reason_is_the_line_naming_the_cause(log_text, cause):
    assert build.failure_reason(log_text) == cause
    assert len(build.failure_reason("x" * 1000)) == 300


def test_a_missing_compiler_says_how_to_get_one(tmp_path, monkeypatch):
    """$CXX (the compiler torch builds with) naming no program: one line naming it and the fix;
    no build starts."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "twell-no-such-compiler")
    with pytest.raises(build.BuildError) as e:
        build.load.__wrapped__("cpu_ffn", openmp=True)
    assert str(e.value).startswith("extension 'cpu_ffn': no C++ compiler: torch builds extensions with "
                                   "$CXX='twell-no-such-compiler', which is not on PATH; ")
    assert "\n" not in str(e.value) and not any(tmp_path.iterdir())
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path))          # no compiler at all
    assert build.missing_compiler() == ("no C++ compiler: torch builds extensions with c++ ($CXX unset), which is "
                                        "not on PATH; install a C++ compiler, e.g. g++ (Debian/Ubuntu: apt-get "
                                        "install g++)")


NO_COMPILER = textwrap.dedent("""
    import torch
    import twell_compile
    from twell_compile.testing import Block, GatedMLP

    with torch.no_grad():
        print(twell_compile.explain(Block(GatedMLP(512, 1408, bias=True), 512), torch.randn(4, 512)))
""")


def test_without_a_compiler_explain_and_the_warning_say_so_in_one_line(tmp_path):
    """A fresh process whose $CXX is missing: explain's reason and the fallback warning each
    hold the one-line reason; no build log anywhere."""
    env = {**os.environ, "CXX": "twell-no-such-compiler", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", NO_COMPILER], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "no C++ compiler: torch builds extensions with $CXX='twell-no-such-compiler', which is not on PATH; " \
        in run.stdout
    (row,) = [ln for ln in run.stdout.splitlines() if ln.startswith("mlp ")]
    assert re.fullmatch(r"mlp +the C\+\+ CPU kernel is unavailable \(torch_impl: extension 'cpu_ffn': no C\+\+ "
                        r"compiler: .*\); plain PyTorch is slower than Inductor; .*", row), row
    warned = [ln for ln in run.stderr.splitlines() if "CPU kernel unavailable" in ln]
    assert len(warned) == 1 and warned[0].endswith(("set CXX=g++", "set CXX=clang++", "install g++)")), warned
    for build_log in ("ninja", "FAILED", "-MMD", "Traceback"):
        assert build_log not in run.stdout + run.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("version,flag", [("2.11.0+cu130", "-std=c++17"), ("2.13.0+cpu", "-std=c++17"),
                                          ("2.14.1+cu130", "-std=c++20"), ("3.0.0", "-std=c++20")])
def test_the_compile_check_uses_the_standard_torchs_headers_need(monkeypatch, version, flag):
    # torch 2.14's headers refuse C++17 (#error); the builds take the standard from cpp_extension
    monkeypatch.setattr(torch, "__version__", version)
    assert build.std_flag() == flag
    assert not any(f.startswith("-std=") for f in build.CXX_FLAGS + build.CUDA_FLAGS)


def test_cutlass_extensions_build_for_hopper_with_ndebug_and_cutlass_headers(tmp_path, monkeypatch):
    """gate_pack (and the probe on CUTLASS) compile sm90a only, with NDEBUG (CuTe's device asserts
    otherwise put a call into the mainloop and ptxas serializes its wgmma) and CUTLASS's include
    directories; the other extensions keep the default flags. Without the headers: one line that
    names the package to install."""
    inc = tmp_path / "cutlass" / "include" / "cutlass"
    inc.mkdir(parents=True)
    (inc / "cutlass.h").write_text("")
    monkeypatch.setenv("CUTLASS_PATH", str(tmp_path / "cutlass"))
    flags = build.cuda_flags("gate_pack")
    assert "-DNDEBUG" in flags and "-gencode=arch=compute_90a,code=sm_90a" in flags
    assert not any("compute_80" in f for f in flags)
    assert f"-I{tmp_path / 'cutlass' / 'include'}" in flags
    assert build.cuda_flags("cutlass_gemm") == flags
    assert build.cuda_flags("cpu_ffn") == build.CUDA_FLAGS
    monkeypatch.setenv("CUTLASS_PATH", str(tmp_path / "nowhere"))
    with pytest.raises(build.BuildError, match=re.escape(build.CUTLASS_PIN)):
        build.cuda_flags("gate_pack")
