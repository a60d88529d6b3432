"""The package's layering (docs/architecture.md), read from the source: kernels/ holds device
code only, passes/ imports only the ops, config, report and formats, the runtime never imports
the graph layer, no module imports or reads another's private names (nor do the tests, but for
the white-box files named here), and module-level imports form no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "twell_compile"
PASSES = ROOT / "passes"


def _module_name(path: Path) -> str:
    if path.is_relative_to(PASSES):
        rel = ("passes",) + path.relative_to(PASSES).with_suffix("").parts
    else:
        rel = path.relative_to(PACKAGE).with_suffix("").parts
    parts = [p for p in rel if p != "__init__"]
    return ".".join(["twell_compile", *parts])


def _sources() -> dict[str, Path]:
    files = list(PACKAGE.rglob("*.py")) + list(PASSES.rglob("*.py"))
    return {_module_name(p): p for p in files}


SOURCES = _sources()


def _imports(path: Path, top_level_only: bool) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) for every ``import``/``from`` of a twell_compile module."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("twell_compile"):
            out.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("twell_compile"):
                    out.append((a.name, [], node.lineno))
    return out


def _targets(module: str, names: list[str]) -> list[str]:
    """The package modules an import statement reaches (a name may be a submodule)."""
    out = [module] if module in SOURCES else []
    out += [f"{module}.{n}" for n in names if f"{module}.{n}" in SOURCES]
    return out


def test_sources_found():
    assert "twell_compile.runtime.select" in SOURCES and "twell_compile.passes.fuse_ffn" in SOURCES


@pytest.mark.parametrize("name", sorted(n for n in SOURCES if n.startswith("twell_compile.kernels")))
def test_kernels_hold_device_code_only(name):
    """kernels/ imports Triton and other kernels modules only: no torch host code, no runtime."""
    tree = ast.parse(SOURCES[name].read_text())
    for node in ast.walk(tree):
        mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for mod in mods:
            assert mod == "__future__" or mod.startswith(("triton", "twell_compile.kernels")), (name, mod)


@pytest.mark.parametrize("name", sorted(n for n in SOURCES if n.startswith("twell_compile.passes")))
def test_passes_import_only_ops_config_report_formats(name):
    allowed = ("twell_compile.ops", "twell_compile.config", "twell_compile.report", "twell_compile.formats",
               "twell_compile.passes")
    for module, names, line in _imports(SOURCES[name], top_level_only=False):
        for target in _targets(module, names) or [module]:
            assert target.startswith(allowed), f"{name}:{line} imports {target}"


@pytest.mark.parametrize("name", sorted(n for n in SOURCES if n.startswith("twell_compile.runtime")))
def test_runtime_never_imports_the_graph_layer(name):
    banned = ("twell_compile.passes", "twell_compile.backend", "twell_compile.prepare", "twell_compile.explain",
              "twell_compile.export", "twell_compile.ops")
    for module, names, line in _imports(SOURCES[name], top_level_only=False):
        for target in _targets(module, names) or [module]:
            assert not target.startswith(banned), f"{name}:{line} imports {target}"


def _private(n: str) -> bool:
    return n.startswith("_") and not n.endswith("__")


def private_uses(path: Path) -> list[str]:
    """Private names of twell_compile modules that ``path`` imports (``from m import _x``) or
    reads off a module it imported (``m._x``, ``twell_compile.runtime.m._x``)."""
    tree = ast.parse(path.read_text())
    bound: dict[str, str] = {}        # local name -> the package module it names
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("twell_compile"):
            for a in node.names:
                if _private(a.name) and f"{node.module}.{a.name}" not in SOURCES:
                    bad.append(f"{path.name}:{node.lineno} imports {node.module}.{a.name}")
                elif f"{node.module}.{a.name}" in SOURCES:
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("twell_compile"):
                    bound[a.asname or "twell_compile"] = a.name if a.asname else "twell_compile"
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain, base = [], node.value
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in bound:
            module = ".".join([bound[base.id], *reversed(chain)])
            if module in SOURCES:
                bad.append(f"{path.name}:{node.lineno} reads {module}.{node.attr}")
    return bad


def test_no_private_names_across_modules():
    """No module imports another's private names or reads them off it (``m._x``)."""
    bad = [f"{name}: {b}" for name, path in SOURCES.items() for b in private_uses(path)]
    assert not bad, bad


def test_private_uses_are_found():
    import tempfile

    src = ("from twell_compile.runtime import density, arch as a\nimport twell_compile.stats\n"
           "from twell_compile.runtime.select import _refuse\n"
           "density._layers, a._x, twell_compile.stats._buffers, density.snapshot, density.__doc__\n")
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "m.py"
        f.write_text(src)
        got = private_uses(f)
    assert got == ["m.py:3 imports twell_compile.runtime.select._refuse",
                   "m.py:4 reads twell_compile.runtime.density._layers", "m.py:4 reads twell_compile.runtime.arch._x",
                   "m.py:4 reads twell_compile.stats._buffers"], got


# White-box tests that read a module's private state, each for what no public call can set up.
TEST_PRIVATE_ALLOWED = {
    # a newer entry at a reused address surviving the old entry's weakref drop (a GC race)
    "tests/runtime/test_decode_state.py",
    # the one-pass argument check passing every valid set (refusing one is only slower)
    "tests/test_ops_fits.py",
}


def test_tests_benchmarks_and_examples_use_public_names():
    """Tests, benchmarks and examples reach the package through its public names, except the
    white-box test files listed."""
    bad = []
    for path in sorted(p for d in ("tests", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel not in TEST_PRIVATE_ALLOWED:
            bad += [f"{rel}: {b}" for b in private_uses(path)]
    assert not bad, bad


def test_module_level_imports_form_no_cycle():
    graph = {name: set() for name in SOURCES}
    for name, path in SOURCES.items():
        for module, names, _ in _imports(path, top_level_only=True):
            graph[name].update(t for t in _targets(module, names) if t != name)
    # a package's __init__ importing its own submodules is not a cycle of the layering
    for name in graph:
        graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for t in sorted(graph[n]):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)


def test_every_package_directory_is_installed():
    """pyproject lists its packages by name: a new subpackage left out of the list would be
    missing from a wheel (an editable install hides that)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"twell_compile." + ".".join(p.parent.relative_to(PACKAGE).parts) if p.parent != PACKAGE else "twell_compile"
             for p in PACKAGE.rglob("__init__.py")}
    assert found | {"twell_compile.passes", "twell_compile.csrc"} == listed, (found, listed)
