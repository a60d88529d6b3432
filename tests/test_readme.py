"""README.md and the docs pages it sends a newcomer to: every code block marked
``<!-- readme-test: NAME -->`` runs in a fresh CPU process and prints exactly the block marked
``<!-- readme-test: NAME-output -->``; the demo's sample output (``demo-output``) holds the
explain table that examples/quickstart.py's CPU model gives, and its timing line has the demo's
format (its numbers are one machine's); every relative link points to a file or heading; the
README stays short."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import twell_compile
from tests.helpers import load_example

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "docs" / "usage.md", ROOT / "docs" / "multi-gpu.md"]
MAX_LINES = 220
_BLOCK = re.compile(r"<!-- readme-test: ([\w-]+) -->\n```[\w]*\n(.*?)```", re.S)

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="the CPU rewrite needs the C++ kernel built")


def blocks(path: Path) -> dict[str, str]:
    """The marked fenced blocks of ``path``, by name."""
    found = _BLOCK.findall(path.read_text())
    names = [name for name, _ in found]
    assert len(names) == len(set(names)), f"{path.name}: a readme-test name used twice: {names}"
    return dict(found)


def mismatches(expected: str, got: str) -> list[str]:
    """Line-by-line differences (empty when equal), for the failure message."""
    want, have = expected.rstrip("\n").splitlines(), got.rstrip("\n").splitlines()
    out = [f"line {i + 1}: README {w!r}\n        printed {h!r}" for i, (w, h) in enumerate(zip(want, have)) if w != h]
    if len(want) != len(have):
        out.append(f"README has {len(want)} lines, the code printed {len(have)}")
    return out


def code_blocks() -> list[tuple[Path, str]]:
    return [(page, name) for page in PAGES for name in blocks(page) if not name.endswith("-output")
            and f"{name}-output" in blocks(page)]


@needs_compiler
@pytest.mark.parametrize("page,name", code_blocks(), ids=lambda v: v.name if isinstance(v, Path) else v)
def test_a_code_block_prints_its_output_block(page, name, tmp_path):
    found = blocks(page)
    if "transformers" in found[name]:
        pytest.importorskip("transformers")
    script = tmp_path / f"{name}.py"
    script.write_text(found[name])
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}             # the CPU branch: the output shown is a CPU's
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    diff = mismatches(found[f"{name}-output"], run.stdout)
    assert not diff, f"{page.name} block {name!r}: its output block is stale:\n" + "\n".join(diff)


def test_the_marked_blocks_are_there():
    assert {"usage", "usage-output", "demo-output"} <= set(blocks(README))
    assert "check_options(" in blocks(README)["usage"]   # torch.compile has no hook to check options early
    assert ("docs/usage.md", "hf-explain") in [(p.relative_to(ROOT).as_posix(), n) for p, n in code_blocks()]


def _quickstart():
    return load_example("quickstart")


@needs_compiler
def test_the_demo_output_holds_the_cpu_demos_explain_table_and_its_timing_line():
    lines = blocks(README)["demo-output"].splitlines()
    q = _quickstart()
    model, tokens = q.demo_model("cpu")
    with torch.no_grad():
        table = str(twell_compile.explain(model, tokens)).splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("twell: ") and "FFN(s) rewritten" in ln)
    diff = mismatches("\n".join(lines[start:start + len(table)]), "\n".join(table))
    assert not diff, "README's demo output: the explain table is stale:\n" + "\n".join(diff)
    digits = lambda s: re.sub(r"\d+", "N", s)  # noqa: E731  (the timings are one machine's)
    assert digits(lines[-1]) == digits(q.timing_line(62, 16, {"twell_cpu_ffn": 30.0})), lines[-1]


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_points_to_a_file_or_heading(page):
    text = page.read_text()
    links = [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    assert links, f"{page.name}: no relative links found (the pattern is broken)"
    for target in links:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: link {target!r} points to a missing file"
        if anchor and file.suffix == ".md":
            ids = {_anchor(h) for h in re.findall(r"^#+ (.*)$", file.read_text(), re.M)}
            assert anchor in ids, f"{page.name}: link {target!r}: no heading {anchor!r} in {file.name}"


def test_the_readme_stays_short():
    assert len(README.read_text().splitlines()) <= MAX_LINES


def test_a_changed_line_is_reported():
    assert mismatches("a\nb\n", "a\nb") == []
    assert mismatches("a\nb", "a\nc") == ["line 2: README 'b'\n        printed 'c'"]
    assert mismatches("a\nb", "a") == ["README has 2 lines, the code printed 1"]
