"""Every committed results file follows benchmarks/rows.py's schema: a JSON list of rows, each
starting with the stamp's fields (gpu, torch, triton, commit, time; null where not recorded),
and benchmarks/results/README.md names each file. ``rows.schema_errors`` is the rule the
writers (``rows.write_json``) and the readers (``rows.load_rows``) apply too."""

import json
from pathlib import Path

import pytest

from benchmarks.rows import STAMP, load_rows, schema_errors, stamp, write_json

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
FILES = sorted(RESULTS.rglob("*.json"))


def test_there_are_results_files():
    assert len(FILES) >= 70, FILES


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(RESULTS).as_posix())
def test_committed_file_is_a_list_of_stamped_rows(path):
    data = json.loads(path.read_text())
    assert not schema_errors(data), schema_errors(data)
    assert data, "no rows"
    assert load_rows(path) == data


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(RESULTS).as_posix())
def test_the_results_readme_names_the_file(path):
    # a file is named by its path under results/, by a brace or star pattern covering it, or
    # (h200x2/l1_40/) by its folder's entry
    readme = (RESULTS / "README.md").read_text()
    rel = path.relative_to(RESULTS).as_posix()
    folder = rel.rsplit("/", 1)[0] if "/" in rel else ""
    assert f"`{rel}`" in readme or rel in readme or f"`{folder}/*.json`" in readme \
        or f"{folder}/{{" in readme, f"benchmarks/results/README.md does not name {rel}"


@pytest.mark.parametrize("data, error", [
    ({"runs": []}, "a JSON dict, not a list of rows"),
    ([[1, 2]], "row 0: a JSON list, not an object"),
    ([{"gpu": "x", "torch": "2", "triton": "3", "commit": "abc"}], "row 0: no ['time']"),
    ([{"torch": "2", "gpu": "x", "triton": "3", "commit": "abc", "time": None}], "row 0: starts"),
    ([{"gpu": "x", "torch": 2.11, "triton": "3", "commit": "abc", "time": None}], "['torch'] neither"),
])
def test_schema_names_each_break(data, error, tmp_path):
    assert any(error in e for e in schema_errors(data)), schema_errors(data)
    with pytest.raises(ValueError, match="not written"):
        write_json(tmp_path / "x.json", data)
    assert not (tmp_path / "x.json").exists()
    (tmp_path / "y.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not a results file of rows"):
        load_rows(tmp_path / "y.json")


def test_a_stamped_row_round_trips(tmp_path):
    rows = [stamp({"M": 1, "ms": float("nan")}, "cpu")]
    write_json(tmp_path / "r.json", rows)
    (got,) = load_rows(tmp_path / "r.json")
    assert list(got)[:len(STAMP)] == list(STAMP) and got["M"] == 1 and got["ms"] != got["ms"]
