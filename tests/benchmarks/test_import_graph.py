"""The benchmarks import each other without a cycle, function-level imports included: the
shared pieces (timing.py's timers and a training point's inputs, rows.py's schema) sit in
modules that import no benchmark, so a harness and the paper's reference (reference.py) both
take them from there instead of from each other."""

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def imports_of(path: Path) -> set[str]:
    """The benchmarks.* modules a file imports anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
            out |= {f"benchmarks.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("benchmarks.")}
    return out


def graph() -> dict[str, set[str]]:
    return {".".join(p.relative_to(BENCH.parent).with_suffix("").parts): imports_of(p) for p in BENCH.rglob("*.py")}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(u: str, path: list[str]) -> None:
        state[u] = "open"
        for v in sorted(g.get(u, ())):
            if state.get(v) == "open":
                found.append(path[path.index(v):] + [v])
            elif v in g and v not in state:
                visit(v, path + [v])
        state[u] = "done"

    for u in sorted(g):
        if u not in state:
            visit(u, [u])
    return found


def test_no_cycle_among_the_benchmarks():
    g = graph()
    assert "benchmarks.bench_ffn_train" in g and "benchmarks.reference" in g["benchmarks.bench_ffn_train"]
    assert cycles(g) == []


def test_the_shared_modules_import_no_benchmark():
    g = graph()
    assert g["benchmarks.timing"] == set() and g["benchmarks.rows"] == set()
    assert g["benchmarks.reference"] <= {"benchmarks.timing", "benchmarks.rows"}


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
