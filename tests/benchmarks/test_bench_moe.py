"""benchmarks/bench_moe.py --tiny runs on the CPU: one row with both backends' times, the
experts rewritten (a measured density) and twell's output as Inductor's."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("transformers")


def test_tiny_moe_row(tmp_path) -> None:
    from benchmarks import bench_moe

    out = tmp_path / "moe.json"
    assert bench_moe.main(["--tiny", "--reps", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["bench"] == "moe" and row["experts"] == 8 and row["top_k"] == 2 and row["mode"] == "forward"
    assert row["inductor_ms"] > 0 and row["twell_ms"] > 0
    assert 0 < row["density_measured"] < 0.05 and row["rows_per_expert"] > 0
    assert row["max_abs_err"] <= 1e-5


def test_nothing_rewritten_raises_with_explain_table(monkeypatch) -> None:
    """SiLU experts: the error carries explain's table with the matcher's reason."""
    import transformers

    from benchmarks import bench_moe

    build = bench_moe.build_block

    def silu_block(a, dtype):
        block = build(a, dtype)
        block.experts.act_fn = transformers.activations.ACT2FN["silu"]
        return block

    monkeypatch.setattr(bench_moe, "build_block", silu_block)
    with pytest.raises(RuntimeError, match="twell rewrote no experts") as info:
        bench_moe.run(bench_moe.parse_args(["--tiny", "--reps", "1"]))
    text = str(info.value)
    assert "0 FFN(s) rewritten, 1 left to Inductor" in text and "gate activation is SiLU, not ReLU" in text, text
    assert "Dynamo's calls" not in text


def test_nothing_ffn_shaped_raises_with_the_graph_calls(monkeypatch) -> None:
    """No FFN-shaped block at all: explain's table is empty, the error lists the graph's calls."""
    from benchmarks import bench_moe

    monkeypatch.setattr(bench_moe, "build_block", lambda a, dtype: torch.nn.Linear(a.hidden, a.hidden).to(dtype))
    with pytest.raises(RuntimeError, match="twell rewrote no experts") as info:
        bench_moe.run(bench_moe.parse_args(["--tiny", "--reps", "1"]))
    text = str(info.value)
    assert "0 FFN(s) rewritten, 0 left to Inductor" in text and "Dynamo's calls" in text, text
    assert re.search(r"\n  linear = linear\(\w+, \w+weight_, \w+bias_\)", text), text
