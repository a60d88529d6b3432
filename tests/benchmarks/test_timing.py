"""benchmarks/timing.py's interleaved rounds (CPU: do_bench stood in by a recorder)."""

from __future__ import annotations

import pytest

from benchmarks import timing


def test_interleaved_rounds_rotate_and_take_the_median(monkeypatch):
    calls = []
    readings = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0]), "c": iter([7.0, 7.0, 1.0])}

    def fake_median_ms(fn, rep):
        name = fn()
        calls.append((name, rep))
        return next(readings[name])

    monkeypatch.setattr(timing, "median_ms", fake_median_ms)
    got = timing.interleaved_ms({n: (lambda n=n: n) for n in "abc"}, reps=60, rounds=3)
    assert [c[0] for c in calls] == list("abc" "bca" "cab")      # one later start each round
    assert all(rep == 20 for _, rep in calls)                  # reps split over the rounds
    assert got == {"a": 3.0, "b": 4.0, "c": 7.0}


def test_interleaved_rejects_no_rounds():
    with pytest.raises(ValueError, match="rounds"):
        timing.interleaved_ms({"a": lambda: None}, reps=10, rounds=0)


def test_policy_changes_types_values_and_rejects_unknown_fields():
    assert timing.policy_changes(["wg_chunk=256", "min_tokens=4096"]) == {"wg_chunk": 256, "min_tokens": 4096}
    assert isinstance(timing.policy_changes(["row_pairs=2"])["row_pairs"], int)
    for bad in (["no_such_field=1"], ["wg_chunk"]):
        with pytest.raises(ValueError, match="FIELD=VALUE"):
            timing.policy_changes(bad)
    # a bool field reads 0/1 and false/true (bool("0") would be True)
    assert timing.policy_changes(["compact_transpose=0"]) == {"compact_transpose": False}
    assert timing.policy_changes(["compact_transpose=True"]) == {"compact_transpose": True}
    with pytest.raises(ValueError, match="0/1"):
        timing.policy_changes(["compact_transpose=yes"])


def test_rows_commit_prefers_twell_commit(monkeypatch):
    from benchmarks import rows
    monkeypatch.delenv("TWELL_COMMIT", raising=False)
    rows.commit.cache_clear()
    head = rows.commit()
    assert head == "unknown" or len(head.removesuffix("+dirty")) == 40
    monkeypatch.setenv("TWELL_COMMIT", "0123abcd" * 5)
    rows.commit.cache_clear()
    assert rows.commit() == "0123abcd" * 5
    rows.commit.cache_clear()
