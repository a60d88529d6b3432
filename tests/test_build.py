"""build.py: a build says so on stderr (before, and its time after); the cache directory is per
package version, torch and Python version, checkout and flags."""

import re
import shutil
import sys

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
    assert err[0] == f"twell: building the CPU kernels twell_cpu_ffn (first use, ~30 s) in {directory} ..."
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
    assert "twell: building the CPU kernels twell_build_probe (first use, ~30 s)" in err
    assert re.search(r"twell: built twell_build_probe in \d+\.\d s", err)
    assert build.is_built("twell_build_probe", out, [src])
    build.build("twell_build_probe", [src], out, ["-O1"])
    assert "twell:" not in capsys.readouterr().err


def test_build_failure_names_the_module_and_directory(tmp_path, capsys):
    src = tmp_path / "broken.cpp"
    src.write_text("this is not C++\n")
    with pytest.raises(build.BuildError, match=r"building extension 'twell_broken' in .*build failed"):
        build.build("twell_broken", [src], tmp_path / "build", ["-O1"])


@pytest.mark.parametrize("version,flag", [("2.11.0+cu130", "-std=c++17"), ("2.13.0+cpu", "-std=c++17"),
                                          ("2.14.1+cu130", "-std=c++20"), ("3.0.0", "-std=c++20")])
def test_the_compile_check_uses_the_standard_torchs_headers_need(monkeypatch, version, flag):
    # torch 2.14's headers refuse C++17 (#error); the builds take the standard from cpp_extension
    monkeypatch.setattr(torch, "__version__", version)
    assert build.std_flag() == flag
    assert not any(f.startswith("-std=") for f in build.CXX_FLAGS + build.CUDA_FLAGS)
