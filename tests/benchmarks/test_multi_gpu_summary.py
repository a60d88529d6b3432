"""benchmarks/multi_gpu_summary.py on synthetic examples/train_ddp.py results files (no runs):
the table, the speed-ups against the 1-GPU one, the loss agreement, and rows for failed or cut
runs, all in the results row schema."""

import json

import pytest

from benchmarks import multi_gpu_summary as MGS
from benchmarks.rows import STAMP, load_rows

LOSSES = [10.8, 9.3, 8.2, 7.0]


def _run(wrap, backend, ms, peak_mb, shift=0.0, complete=True, steps=4):
    world = 1 if wrap == "none" else 2
    ranks = [{"rank": r, "peak_memory_mb": peak_mb - 10 * r,
              "rewritten": [f"model.layers.{i}.mlp -> twell::ffn_train (prepared)" for i in range(2)]
              if backend == "twell" else [], "left_to_inductor": [], "dynamo_graphs": 1,
              "ddp_graph_pieces": [12] if wrap == "ddp" else None} for r in range(world)]
    run = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "commit": "0123abc",
           "time": "2026-11-26T08:00:00Z", "wrap": wrap, "backend": backend, "world": world,
           "accum": 2 if world == 1 else 1, "device": "cuda", "size": {"layers": 2, "hidden": 64, "ffn": 176}, "global_batch": 8,
           "tokens_per_step": 16384, "micro_batch_tokens": 8192, "steps": 4, "warmup": 1, "fixed_batch": True,
           "density_target": 0.005, "density_calibration_mean": 0.005, "l1": 2e-5, "bf16": True,
           "density_first_batch": [0.004, 0.006], "losses": [v + shift for v in LOSSES[:steps]],
           "median_step_ms": ms, "tokens_per_s": 16384 / ms * 1e3, "first_step_s": 40.0, "complete": complete}
    if complete:
        run.update(ranks=ranks, peak_memory_mb_max=max(r["peak_memory_mb"] for r in ranks))
    else:
        run["peak_memory_mb_rank0"] = peak_mb
    return run


@pytest.fixture
def out(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    files = {
        "single_inductor": _run("none", "inductor", 200.0, 30000),
        "single_twell": _run("none", "twell", 160.0, 27000),            # 1.25x
        "fsdp2_inductor": _run("fsdp2", "inductor", 120.0, 12000, shift=1e-3),
        "fsdp2_twell": _run("fsdp2", "twell", 100.0, 11000, shift=-4e-3),  # 1.20x = 0.96 of 1.25
        "ddp_inductor": _run("ddp", "inductor", 105.0, 20000, shift=0.05),  # loss off by 0.05
        "ddp_twell": _run("ddp", "twell", 150.0, 19000, complete=False, steps=2),  # cut: 0.70x = 0.56
    }
    for name, run in files.items():
        (runs / f"{name}.json").write_text(json.dumps([run]))   # train_ddp.py --out: one row
    log = tmp_path / "run.log"
    log.write_text("\n".join(f"### end {n} rc={124 if n == 'ddp_twell' else 0} wall_s=60" for n in files)
                   + "\nstep 0 ...\n")
    return tmp_path


def test_summary_speedups_losses_and_table(out, capsys):
    s = MGS.main(["--runs", str(out / "runs"), "--log", str(out / "run.log"), "--out", str(out / "s.json")])
    assert load_rows(out / "s.json") == json.loads(json.dumps(s))
    assert [r["config"] for r in s] == list(MGS.CONFIGS)
    rows = {r["config"]: r for r in s}
    twell = {w: rows[f"{w}_twell"] for w in MGS.WRAPS}
    assert {w: r["speedup_twell_over_inductor"] for w, r in twell.items()} == {"single": 1.25, "fsdp2": 1.2, "ddp": 0.7}
    assert {w: r.get("speedup_vs_single_gpu") for w, r in twell.items()} == {"single": None, "fsdp2": 0.96, "ddp": 0.56}
    assert twell["fsdp2"]["criterion_speedup_ge_95pct_of_single"] and not twell["ddp"]["criterion_speedup_ge_95pct_of_single"]
    assert twell["single"]["peak_memory_twell_over_inductor"] == pytest.approx(0.9)
    assert "speedup_twell_over_inductor" not in rows["single_inductor"]       # the pair's figures: on twell's row
    agree = {n: r["loss_vs_1gpu"] for n, r in rows.items() if "loss_vs_1gpu" in r}
    assert sorted(agree) == ["ddp_inductor", "ddp_twell", "fsdp2_inductor", "fsdp2_twell"]
    assert agree["fsdp2_inductor"]["max_abs"] == pytest.approx(1e-3) and agree["fsdp2_inductor"]["within_tol"]
    assert agree["fsdp2_twell"]["max_abs"] == pytest.approx(4e-3)
    assert agree["ddp_inductor"]["max_abs"] == pytest.approx(0.05) and not agree["ddp_inductor"]["within_tol"]
    assert agree["ddp_twell"]["steps_compared"] == 2 and agree["ddp_twell"]["steps_both"] == [2, 4]
    assert all(r["settings"] == s[0]["settings"] for r in s) and s[0]["settings"]["gpu"] == "NVIDIA H200"
    assert rows["fsdp2_twell"]["ffns_rewritten_per_rank"] == [2, 2] and rows["fsdp2_twell"]["gpus"] == 2
    assert rows["single_twell"]["ffns_rewritten_per_rank"] == [2] and rows["single_twell"]["gpus"] == 1
    assert rows["fsdp2_inductor"]["peak_memory_mb"] == 12000
    assert rows["fsdp2_inductor"]["peak_memory_mb_per_rank"] == [12000, 11990]
    assert rows["ddp_inductor"]["ddp_graph_pieces_per_rank"] == [[12], [12]]
    # stamped rows (benchmarks/rows.py): the run's GPU, versions and commit, this process's time
    assert list(rows["fsdp2_twell"])[:5] == list(STAMP)
    assert rows["fsdp2_twell"]["gpu"] == "NVIDIA H200" and rows["fsdp2_twell"]["commit"] == "0123abc"
    assert rows["fsdp2_twell"]["time"].endswith("Z") and rows["fsdp2_twell"]["time"] != "2026-11-26T08:00:00Z"
    cut = rows["ddp_twell"]
    assert cut["rc"] == 124 and not cut["complete"] and cut["steps_done"] == 2 and cut["peak_memory_mb"] == 19000
    table = MGS.table(s, "H200").splitlines()
    assert table[0].startswith("| GPUs | wrap | backend | step time | tokens/s | peak memory | FFNs rewritten per rank")
    assert "| 2x H200 | FSDP2 | twell (prepared) | 100.0 ms | 163,840 | 10.74 GiB | 2, 2 | 4.00e-03 | ok |" in table
    cut_line = next(line for line in table if line.startswith("| 2x H200 | DDP | twell (prepared) | 150.0 ms |"))
    assert cut_line.endswith("| rc=124, 2 steps |")
    text = capsys.readouterr().out
    assert "speed-up twell / inductor, fsdp2: 1.200x = 0.960 of the 1-GPU speed-up (>= 0.95)" in text
    assert "loss ddp_inductor vs 1 GPU: max |diff| 5.00e-02" in text and "OUTSIDE 0.02" in text


def test_missing_and_skipped_runs_keep_a_row(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "single_inductor.json").write_text(json.dumps([_run("none", "inductor", 200.0, 30000)]))
    (runs / "single_twell.json").write_text("[{\"wrap\": ")          # cut while writing
    (runs / "ddp_twell.json").write_text(json.dumps(_run("ddp", "twell", 100.0, 19000)))   # an object, not rows
    log = tmp_path / "run.log"
    log.write_text("### end single_inductor rc=0 wall_s=90\n### end single_twell rc=137 wall_s=150\n"
                   "### end ddp_inductor rc=skipped wall_s=0 (10s left of TOTAL_S=530)\n")
    s = MGS.summarize(runs, log)
    rows = {r["config"]: r for r in s}
    assert set(rows) == {"single_inductor", "single_twell", "ddp_inductor", "ddp_twell"}
    assert rows["single_twell"]["rc"] == 137 and "unreadable JSON" in rows["single_twell"]["error"]
    assert rows["ddp_inductor"]["rc"] == "skipped" and not rows["ddp_inductor"]["complete"]
    assert "not a one-row results file" in rows["ddp_twell"]["error"] and not rows["ddp_twell"]["complete"]
    assert not any("speedup_twell_over_inductor" in r or "loss_vs_1gpu" in r for r in s)
    assert "rc=skipped" in MGS.table(s, "H200") and "rc=skipped" in MGS.report(s)
