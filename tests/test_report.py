"""Report: the mode line explain adds, and documented fields."""

import dataclasses

import pytest

from twell_compile.report import RejectionEntry, Report, RewriteEntry


def _entry(op):
    return RewriteEntry("layers.0.mlp", True, op, "[2, 5]", 16, 40, 16, "float32", "0")


@pytest.mark.parametrize("mode, says, other", [("training", "mode: training", "torch.no_grad()"),
                                               ("inference", "mode: inference", "requires_grad=True")])
def test_mode_line_says_the_mode_and_how_to_get_the_other(mode, says, other):
    lines = str(Report(rewrites=[_entry("twell::ffn")], graphs=1, mode=mode)).splitlines()
    assert lines[1].startswith(says) and other in lines[1]
    # prepare and export set no mode: no line
    assert "mode:" not in str(Report(rewrites=[_entry("prepared")], by_prepare=True))


@pytest.mark.parametrize("cls", [Report, RewriteEntry, RejectionEntry])
def test_every_field_is_documented(cls):
    doc = cls.__doc__
    for f in dataclasses.fields(cls):
        assert f"\n    {f.name}: " in doc, f"{cls.__name__}.{f.name} undocumented"
    if cls is RewriteEntry:
        assert doc.count("elements") == 3   # k, n, k_out
