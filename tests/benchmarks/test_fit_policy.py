"""benchmarks/fit_policy.py on synthetic rows (no results files): the inference and decode
checks pass where the measurements agree with the record's rules and name each point where they
do not, and the decode fit recovers the constants that generated the times."""

import dataclasses
import json

import pytest

from benchmarks import fit_policy
from benchmarks.rows import stamp
from twell_compile.runtime import arch, select

P = arch.H200
K, N = 2048, 5632


def _infer_row(m, d, kernel_ms, inductor_ms, **extra):
    return dict(M=m, K=K, N=N, density=d, tail=0.0, nnz_per_row=d * N, kernel_ms=kernel_ms,
                inductor_ms=inductor_ms, twell_ms=inductor_ms, path="dense", **extra)


def _infer_rows():
    """Rows the H200 rule gets right: TwELL (d < 0.0114 at K=2048) where it is faster, dense
    where it is slower; rows under min_tokens or without a forced kernel are not checked."""
    rows = []
    for m in (16384, 65536):
        rows += [_infer_row(m, d, 0.6, 1.0) for d in (0.002, 0.005, 0.008, 0.01)]
        rows += [_infer_row(m, d, 1.5, 1.0) for d in (0.02, 0.05, 0.1)]
    rows.append(_infer_row(1024, 0.005, 9.0, 1.0))                 # under min_tokens: the rule is not for it
    rows.append(_infer_row(16384, 0.5, float("nan"), 1.0))        # kernel not timed there
    return rows


def test_inference_rule_passes_where_the_measurements_agree():
    c = fit_policy.check_inference(P, _infer_rows(), min_rows=14)
    assert c.ok, c.report()
    assert "14 rows at M >= 4096; TwELL at 8" in c.summary and "dense at 6" in c.summary


def test_inference_rule_names_a_slow_twell_pick_and_a_missed_win():
    rows = _infer_rows()
    rows[0]["kernel_ms"] = 1.05                                   # TwELL picked, 1.05x of Inductor
    rows[5]["kernel_ms"] = 0.8                                    # dense picked, TwELL 1.25x faster
    c = fit_policy.check_inference(P, rows, min_rows=14)
    assert not c.ok and len(c.failures) == 2
    assert "M=16384 K=2048 N=5632 d=0.002" in c.failures[0] and "1.05x" in c.failures[0]
    assert "d=0.05" in c.failures[1] and "1.25x faster" in c.failures[1]
    assert not fit_policy.check_inference(P, _infer_rows(), min_rows=20).ok      # too few rows


def test_the_band_under_min_tokens_is_checked_with_graphs_margin_against_inductors_fastest_reading():
    """Under min_tokens (2048-4095 tokens on the H200 record, graphs only) the rule takes
    graphs_margin (0.75: TwELL to d=0.0072 gated, 0.0041 non-gated); a point's Inductor time is
    the fastest reading of its shape, whatever the density (a slow reading is the host's)."""
    rows = [_infer_row(2048, d, t, 1.0, gated=True) for d, t in ((0.003, 0.7), (0.005, 0.85), (0.009, 1.1))]
    rows += [_infer_row(2048, d, t, ind, gated=False) for d, t, ind in ((0.003, 0.66, 0.7), (0.008, 0.8, 1.3))]
    rows.append(_infer_row(4096, 0.009, 9.0, 1.0, gated=True))     # at min_tokens: check_inference's
    c = fit_policy.check_graphs_band(P, rows, min_rows=5)
    assert c.ok, c.report()
    assert "5 rows at 2048 <= M < 4096; TwELL at 3" in c.summary and "dense at 2" in c.summary
    # non-gated d=0.008 is dense: TwELL's 0.8 ms against Inductor's fastest 0.7, not its 1.3
    wide = dataclasses.replace(P, graphs_margin=0.0)               # the large-M margin, 0.95
    c = fit_policy.check_graphs_band(wide, rows, min_rows=5)
    assert not c.ok and any("d=0.009 gated: rule runs TwELL" in f for f in c.failures), c.report()
    assert select.twell_wins(P, 0.009, True, K, N, K, 2) and not select.twell_wins(P, 0.009, True, K, N, K, 2, 2048)
    assert select.twell_wins(P, 0.009, True, K, N, K, 2, 4096)     # from min_tokens: the margin


def test_inference_time_is_the_lower_of_kernel_and_op_where_the_op_ran_twell():
    assert fit_policy.twell_ms(dict(kernel_ms=1.0, op_ms=0.9, op_path="twell", twell_ms=2.0, path="inductor")) == 0.9
    assert fit_policy.twell_ms(dict(kernel_ms=1.0, op_ms=0.9, op_path="dense", twell_ms=2.0, path="twell")) == 1.0
    # rows before the product column: the op's time and path were twell_ms and path
    assert fit_policy.twell_ms(dict(kernel_ms=1.0, twell_ms=0.8, path="twell")) == 0.8


def _decode_rows(p=P):
    """A decode grid as the record predicts it: times from the cost model (form_ms from
    decode_us at the union the model expects, dense from dense_us), the op's path the rule's."""
    rows = []
    for k, n in ((2048, 5632), (4096, 11008)):
        for d in (0.005, 0.02, 0.05, 0.2):
            for m in (1, 2, 4, 8, 16, 32, 64):
                us = select.decode_us(p, d, m, k, n, k)
                dense = select.dense_us(p, k, n, k, True)
                form = select.decode_pick(p, d, m, k, n, k, True)
                op_us = us[form] if form else dense
                rows.append(dict(M=m, K=k, N=n, density=d, nnz_per_row=d * n, kernel="decode",
                                 union=select.union_fraction(d, min(m, arch.MAX_MB)) * n,
                                 dense_ms=dense / 1e3, twell_ms=op_us / 1e3, kernel_ms=min(us.values()) / 1e3,
                                 kernel_form=min(us, key=us.get), form_ms={f: t / 1e3 for f, t in us.items()},
                                 path=f"decode-{form}" if form else "dense"))
    return rows


def test_decode_rule_passes_on_its_own_predictions():
    rows = _decode_rows()
    picks = sum(r["path"] != "dense" for r in rows)
    c = fit_policy.check_decode(P, rows, min_picks=picks)
    assert c.ok, c.report()
    assert f"decode at {picks}" in c.summary
    assert not fit_policy.check_decode(P, rows, min_picks=picks + 1).ok


def test_decode_rule_names_a_point_whose_path_differs():
    rows = _decode_rows()
    i = next(i for i, r in enumerate(rows) if r["path"] == "dense" and r["M"] == 64)
    rows[i]["path"] = "decode-tiles"
    j = next(j for j, r in enumerate(rows) if r["path"].startswith("decode-"))
    rows[j]["twell_ms"] = rows[j]["dense_ms"] / 0.9                 # the op ran 0.90x of dense
    c = fit_policy.check_decode(P, rows, min_picks=0)
    r, s = rows[i], rows[j]
    assert f"M=64 K={r['K']} N={r['N']} d={r['density']}: rule takes dense, the op ran decode-tiles" in c.failures
    assert any(f"M={s['M']} K={s['K']} N={s['N']} d={s['density']}: the op ran 0.90x of dense" in f
               for f in c.failures)


def test_decode_fit_recovers_the_constants_behind_the_times():
    rows = _decode_rows()
    fit = fit_policy.fit_decode(P, fit_policy.decode_points(rows))
    assert fit["kept"] == []
    for form, values in fit["decode_forms"].items():
        assert values == pytest.approx(P.decode_forms[form], rel=2e-3, abs=1e-3), form
    assert (fit["dense_fixed_us"], fit["dense_gbps"]) == pytest.approx((P.dense_fixed_us, P.dense_gbps), rel=1e-3)
    assert fit_policy.check_fit(P, rows).ok
    other = dataclasses.replace(P, decode_forms={**P.decode_forms, "rows": (6.0,) + P.decode_forms["rows"][1:]})
    c = fit_policy.check_fit(other, rows)
    assert c.failures == ["decode_forms['rows'][0]: record 6.0, fit 5.11"]
    # printed as the record's fields, and written for bench_decode.py --policy
    assert "'pairs': (2.84, 1467.0, 0.0, 0.2871)," in fit_policy.record_text(fit)
    assert json.loads(fit_policy.policy_json(fit))["dense_gbps"] == fit["dense_gbps"]


def test_main_checks_files_and_exits_nonzero_on_a_violation(tmp_path, capsys):
    infer, dec = tmp_path / "infer.json", tmp_path / "decode.json"
    infer.write_text(json.dumps([stamp(r) for r in _infer_rows() * 2]))   # results files: stamped rows
    rows = [stamp(r) for r in _decode_rows()]
    dec.write_text(json.dumps(rows))
    argv = ["--check", "--inference", str(infer), "--decode", str(dec), "--min-decode-picks", "1"]
    assert fit_policy.main(argv) == 0
    assert capsys.readouterr().out.strip().endswith("check: ok")
    rows[0]["path"] = "dense" if rows[0]["path"] != "dense" else "decode-rows"
    dec.write_text(json.dumps(rows))
    assert fit_policy.main(argv) == 1
    assert "FAILED: decode rule (H200)" in capsys.readouterr().out
    dec.write_text(json.dumps({"rows": rows}))                    # any other shape is refused, named
    with pytest.raises(ValueError, match="not a results file of rows: a JSON dict"):
        fit_policy.main(argv)
