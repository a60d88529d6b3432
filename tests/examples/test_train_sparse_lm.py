"""examples/train_sparse_lm.py on a tiny model and a small slice of the stdlib corpus (CPU)."""

import json

import pytest
import torch

from tests.helpers import load_example

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")
pytest.importorskip("tqdm")

T = load_example("train_sparse_lm")

TINY = ["--corpus-mb", "0.4", "--vocab", "512", "--d-model", "32", "--layers", "2", "--heads", "2", "--ffn", "128",
        "--seq", "32", "--batch", "8", "--lr", "3e-3", "--warmup", "5", "--eval-every", "1000", "--eval-batches", "2",
        "--log-every", "10", "--dead-probe-every", "0", "--dead-check-every", "0", "--no-plots", "--no-progress",
        "--threads", "2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def run(out, cache, *extra):
    return T.train(T.parse_args(["--out", str(out), "--cache-dir", cache, *TINY, *extra]))


def test_l1_option_raises_sparsity(tmp_path, cache):
    dense = run(tmp_path / "dense", cache, "--steps", "40", "--baseline")
    sparse = run(tmp_path / "sparse", cache, "--steps", "40", "--l1", "20")
    # Same seed and data: only the L1 term differs. Measured margin is far wider than 2x.
    assert sparse["mean_nnz_per_token"] < 0.5 * dense["mean_nnz_per_token"], (sparse, dense)
    for s, d in zip(sparse["nnz"].values(), dense["nnz"].values()):
        assert s["mean"] < d["mean"]
    # The training log's per-layer counts (from twell's layer_stats) agree in direction.
    last = lambda p: [json.loads(l) for l in (p / "metrics.jsonl").read_text().splitlines()
                      if json.loads(l)["kind"] == "train"][-1]
    ls, ld = last(tmp_path / "sparse"), last(tmp_path / "dense")
    assert sum(ls["nnz_per_token"].values()) < sum(ld["nnz_per_token"].values())
    assert ls["l1"] == 20 and ld["l1"] == 0 and ls["l1_penalty"] > 0 == ld["l1_penalty"]


def test_checkpoint_reload_and_resume_are_exact(tmp_path, cache):
    from safetensors.torch import load_file

    # Eager backend: checkpointing is independent of the compiler, and this keeps the test fast.
    straight = tmp_path / "straight"
    run(straight, cache, "--steps", "12", "--ckpt-every", "6", "--backend", "eager", "--l1", "0")
    split = tmp_path / "split"
    run(split, cache, "--steps", "12", "--ckpt-every", "6", "--backend", "eager", "--l1", "0", "--stop-after", "6")
    assert (split / "ckpt" / "latest").read_text().strip() == "step_0000006"
    run(split, cache, "--steps", "12", "--ckpt-every", "6", "--backend", "eager", "--l1", "0", "--resume", "auto")
    a = load_file(str(straight / "ckpt" / "step_0000012" / "model.safetensors"))
    b = load_file(str(split / "ckpt" / "step_0000012" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # A fresh model loaded from the checkpoint gives the trained model's outputs exactly.
    args = T.parse_args(["--out", str(straight), "--cache-dir", cache, *TINY])
    data = T.load_data(args)
    m1 = T.build_model(args, data["tokenizer"].get_vocab_size())
    T.load_checkpoint(straight / "ckpt" / "step_0000012", m1)
    args.seed = 123  # different init: everything must come from the file
    m2 = T.build_model(args, data["tokenizer"].get_vocab_size())
    x = data["val"][: 2 * 32].view(2, 32)
    assert not torch.equal(m1(input_ids=x).logits, m2(input_ids=x).logits)
    T.load_checkpoint(straight / "ckpt" / "step_0000012", m2)
    m1.eval(), m2.eval()
    with torch.no_grad():
        assert torch.equal(m1(input_ids=x).logits, m2(input_ids=x).logits)


def test_dead_neuron_reinit_changes_exactly_the_dead_rows(tmp_path, cache):
    args = T.parse_args(["--out", str(tmp_path), "--cache-dir", cache, *TINY])
    data = T.load_data(args)
    model = T.build_model(args, data["tokenizer"].get_vocab_size())
    opt = T.make_optimizer(model, args)
    x = data["train"][: 4 * 32].view(4, 32)
    torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), x.roll(-1, 1).flatten()).backward()
    opt.step()  # populate AdamW moments
    # Kill some gate rows: an all-zero row gives relu(0) = 0 on every token, so it never fires.
    kill = {"model.layers.0.mlp": [3, 17, 100], "model.layers.1.mlp": [0, 127]}
    mlps = dict(T.mlps(model))
    with torch.no_grad():
        for name, rows in kill.items():
            mlps[name].gate_proj.weight[rows] = 0
    fired = T.probe_fired(model, x, args)
    dead = {k: ~v for k, v in fired.items()}
    for name, rows in kill.items():
        assert set(rows) <= set(dead[name].nonzero().flatten().tolist())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    T.reinit_dead_rows(model, opt, dead, step=7, seed=0)
    for n, p in model.named_parameters():
        layer = n.rsplit(".gate_proj.weight", 1)[0] if n.endswith("gate_proj.weight") else None
        if layer is None:
            assert torch.equal(p, before[n]), n
            assert all(torch.equal(opt.state[p][k], moments[n][k]) for k in moments[n]), n
            continue
        rows = dead[layer]
        changed = (p != before[n]).any(1)
        assert torch.equal(changed, rows), n  # exactly the dead rows moved
        # W <- 0.9 W + 0.1 N(0, 0.02^2): on the killed (zero) rows, the new values are 0.1 * noise.
        killed = p[kill[layer]]
        assert 0.0005 < killed.std().item() < 0.005
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.all(opt.state[p][k][rows] == 0)
            assert torch.equal(opt.state[p][k][~rows], moments[n][k][~rows])


def test_progress_bar_starts_after_the_compile_and_the_run_ends_with_its_outputs(tmp_path, cache, capsys, monkeypatch):
    import tqdm.auto

    out, profile = tmp_path / "run", tmp_path / "nnz.json"
    made = []

    class Bar(tqdm.auto.tqdm):
        def __init__(self, *a, **kw):
            # The bar's timer starts here: the compile step must be done and logged already.
            made.append((kw.get("initial"), (out / "metrics.jsonl").read_text()))
            super().__init__(*a, **kw)

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    T.main(["--out", str(out), "--cache-dir", cache, *TINY, "--steps", "3", "--l1", "1",
            "--profile-out", str(profile)])
    assert len(made) == 1 and made[0][0] == 1 and '"kind": "compile"' in made[0][1]
    captured = capsys.readouterr()
    assert "compiling (first step; ~35 s)..." in captured.err
    lines = captured.out.strip().splitlines()
    assert lines[0].startswith("final: val loss")
    assert lines[1].split() == ["checkpoint", str(out / "ckpt" / "step_0000003")]
    assert lines[2].split() == ["metrics", str(out / "metrics.jsonl")]
    assert lines[3].startswith("  plots       none (--no-plots)")
    assert lines[4].split() == ["profile", str(profile)] and profile.exists()
    cmd = lines[5].split("make plots: ")[1].split()
    assert cmd[0] == "python" and cmd[1].endswith("plot_training.py") and cmd[2:] == [str(out), "--out", str(out / "plots")]


def test_resume_auto_on_a_finished_run_says_it_is_complete(tmp_path, cache, capsys):
    out = tmp_path / "run"
    argv = ["--out", str(out), "--cache-dir", cache, *TINY, "--steps", "3", "--backend", "eager", "--l1", "0"]
    T.main(argv)
    log = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    T.main(argv + ["--resume", "auto"])  # crashed formatting val_loss None
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"run complete: {out} is at step 3 of --steps 3, nothing to resume " \
                       "(a new run needs another --out, or no --resume)"
    assert lines[1].split() == ["checkpoint", str(out / "ckpt" / "step_0000003")]
    assert (out / "metrics.jsonl").read_text() == log  # nothing appended


def test_stopped_run_says_how_to_continue(tmp_path, cache, capsys):
    out = tmp_path / "run"
    T.main(["--out", str(out), "--cache-dir", cache, *TINY, "--steps", "6", "--ckpt-every", "2", "--backend",
            "eager", "--l1", "0", "--stop-after", "3"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "stopped at step 3 of 6: continue with --resume auto"
    assert lines[1].split() == ["checkpoint", str(out / "ckpt" / "step_0000002")]


def test_target_density_trains_logs_and_checkpoints_the_controller(tmp_path, cache):
    """--target-density gives the backend twell.target_density (no fixed L1): the log carries each
    layer's coefficient, target and dead units, and a checkpoint carries the coefficients, which
    load_checkpoint restores."""
    import twell_compile

    twell_compile.reset_controller()
    out = tmp_path / "target"
    run(out, cache, "--steps", "20", "--ckpt-every", "20", "--target-density", "0.05")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    assert train[-1]["target_density"] == 0.05 and train[-1]["l1"] == 0
    coefs = [list(r["l1_coef"].values()) for r in train]
    assert len(coefs[-1]) == 2 and coefs[0] != coefs[-1] and all(c > 0 for c in coefs[-1])
    assert set(train[-1]["dead_units"]) == set(train[-1]["l1_coef"]) and train[-1]["l1_penalty"] > 0
    ckpt = out / "ckpt" / "step_0000020"
    saved = torch.load(ckpt / "controller.pt")
    assert set(saved) == set(train[-1]["l1_coef"])
    twell_compile.reset_controller()
    args = T.parse_args(["--out", str(out), "--cache-dir", cache, *TINY])
    model = T.build_model(args, T.load_data(args)["tokenizer"].get_vocab_size())
    T.load_checkpoint(ckpt, model)
    now = twell_compile.controller_state_dict()
    assert all(torch.equal(now[k]["log_coef"], saved[k]["log_coef"]) for k in saved)
    twell_compile.reset_controller()
    with pytest.raises(SystemExit, match="--target-steps needs --target-density"):
        T.parse_args(["--out", str(out), "--target-steps", "5"])
