"""twell_compile/testing.py: the synthetic FFN generator (anchors.md's recipe), the replay
of a non-zeros-per-token profile, in the format examples/train_sparse_lm.py --profile-out
writes (a long-tailed one is made here; the measured ones live in benchmarks/profiles/), and
the realistic-activity generator of a benchmarks/activity_profile.py profile (a synthetic one
made here with known rates, dead neurons, position buckets and stickiness; the committed
profiles loaded as they are)."""

import json
import math
from pathlib import Path

import pytest
import torch

from twell_compile.testing import (ACTIVITY_FORMAT, CHECKPOINT_FORMAT, activity_plan, check_activity_layer,
                                   load_activity_profile, load_checkpoint_ffn, load_profile, make_ffn,
                                   make_ffn_activity, make_ffn_for, make_ffn_profile, parse_activity)

PROFILES = Path(__file__).resolve().parents[1] / "benchmarks" / "profiles"


@pytest.fixture
def profile_path(tmp_path):
    """Two layers; the denser one long-tailed: 75% of tokens with no non-zero of 4096, 1% over 100."""
    values = [0, 1, 2, 3, 4, 8, 16, 32, 64, 128, 256]
    counts = [6000, 500, 300, 200, 150, 300, 200, 150, 100, 70, 30]
    total = sum(counts)
    mean = sum(v * c for v, c in zip(values, counts)) / total
    cum, quantiles = 0, {}
    for q in (0.0, 0.5, 0.9, 0.99, 1.0):
        acc = 0
        for v, c in zip(values, counts):
            acc += c
            if acc >= q * total:
                quantiles[str(q)] = float(v)
                break
    dense = dict(hidden=4096, tokens=total, mean=mean, density=mean / 4096, quantiles=quantiles,
                 hist_values=values, hist_counts=counts)
    quiet = dict(dense, mean=0.1, density=0.1 / 4096, hist_values=[0, 1], hist_counts=[9000, 900],
                 quantiles={"0.0": 0.0, "0.5": 0.0, "0.9": 0.0, "0.99": 1.0, "1.0": 1.0})
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"layers": {"model.layers.0.mlp": quiet, "model.layers.1.mlp": dense}}))
    return path


def _nnz(p):
    return (torch.nn.functional.linear(p["x"].float(), p["w_gate"].float()) > 0).sum(-1).double()


@pytest.mark.parametrize("density", [0.005, 0.05, 0.3])
def test_anchor_generator_hits_the_density(density):
    p = make_ffn(2048, 256, 1024, density, dtype=torch.float32, device="cpu", seed=1)
    measured = _nnz(p).mean().item() / 1024
    assert measured == pytest.approx(density, rel=0.15)


def test_profile_replay_matches_the_measured_distribution(profile_path):
    name, prof = load_profile(str(profile_path))
    layers = json.load(open(profile_path))["layers"]
    assert name == "model.layers.1.mlp"
    assert prof["density"] == max(v["density"] for v in layers.values())  # the densest by default
    n = 4096
    p = make_ffn_profile(8192, 512, n, prof, dtype=torch.float32, device="cpu", seed=3)
    dens = _nnz(p) / n
    assert dens.mean().item() == pytest.approx(float(prof["density"]), rel=0.15)
    # The long tail carries over: the busiest 1% of tokens are many times the median.
    q = prof["quantiles"]
    want_ratio = float(q["0.99"]) / max(float(q["0.5"]), 1.0)
    got_ratio = dens.quantile(0.99).item() / max(dens.quantile(0.5).item(), 1.0 / n)
    assert got_ratio > 0.5 * want_ratio
    # Tokens with no active neuron appear about as often as in the profile.
    zero_frac = prof["hist_counts"][prof["hist_values"].index(0)] / sum(prof["hist_counts"])
    assert (dens == 0).double().mean().item() == pytest.approx(zero_frac, abs=0.1)


def test_unknown_profile_layer_is_named(profile_path):
    with pytest.raises(ValueError, match="not in"):
        load_profile(str(profile_path), "model.layers.99.mlp")


# ----------------------------------------------------------------------------- realistic activity

SEQ = 256
LAGS = [1, 2, 4, 8, 16, 32, 64, 128]
EDGES = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256]
POS_F = [4.0, 4.0, 3.5, 3.0, 2.5, 2.0, 1.5, 1.2, 0.9]     # early buckets ~4x the last one


def activity_layer(n=512, sequences=16, dead=0.1, stick=0.5, groups=True, seed=0):
    """A layer as activity_profile.py writes it: lognormal rates (median 1%, sd 1 in log) with
    ``dead`` of the neurons never firing, POS_F's position dependence and P(next | active) rising
    with the rate (group g of 8: independence + stick * (g + 1) / 8, decaying over lags to 40%)."""
    g = torch.Generator().manual_seed(seed)
    t = sequences * SEQ
    rates = torch.exp(math.log(0.01) + torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=0.2)
    counts = (rates * t).round().clamp(min=1)
    counts[torch.randperm(n, generator=g)[:int(dead * n)]] = 0
    r = counts / t
    density = float(r.mean())
    sizes = torch.tensor([hi - lo for lo, hi in zip(EDGES, EDGES[1:])], dtype=torch.float64)
    f = torch.tensor(POS_F, dtype=torch.float64)
    f = f / float((f * sizes).sum() / sizes.sum())
    live = (counts > 0).nonzero().flatten()
    order = live[counts[live].argsort(stable=True)]
    decay = [0.4 + 0.6 * math.exp(-k / 32) for k in LAGS]
    g_rate, g_next, weight = [], [], []
    for i, idx in enumerate(order.chunk(8)):
        rg = float(r[idx].mean())
        g_rate.append(rg)
        g_next.append([rg + stick * (i + 1) / 8 * d for d in decay])
        weight.append(float(r[idx].sum()))
    pooled = [sum(w * gn[j] for w, gn in zip(weight, g_next)) / sum(weight) for j in range(len(LAGS))]
    layer = dict(hidden=n, tokens=t, mean=density * n, density=density, seq=SEQ, sequences=sequences,
                 counts=[int(c) for c in counts], dead_frac=float((counts == 0).double().mean()),
                 position=dict(edges=EDGES, density=[density * float(v) for v in f]),
                 lag={"from": 16, "lags": LAGS, "p_next": pooled,
                      "p_independent": float((r * r).sum() / r.sum())},
                 token_cv=0.5)
    if groups:
        layer["lag_by_rate"] = dict(rate=g_rate, p_next=g_next)
    return layer


def activity(p):
    """relu(gate(x)) > 0 of make_ffn's dict, [M, N] bool."""
    return torch.nn.functional.linear(p["x"].float(), p["w_gate"].float()) > 0


def p_next(a, lag, start=16):
    """Pooled P(active at t + lag | active at t), t >= start, over sequences of SEQ (as the profile)."""
    a = a.reshape(-1, SEQ, a.shape[-1])[:, start:]
    return float((a[:, :-lag] & a[:, lag:]).sum() / a[:, :-lag].sum())


@pytest.fixture(scope="module")
def generated():
    prof = activity_layer()
    p = make_ffn_activity(16 * SEQ, 96, 512, prof, seq=SEQ, dtype=torch.float32, device="cpu", seed=5)
    return prof, p, activity(p)


def test_activity_generator_reproduces_the_neuron_rates(generated):
    prof, p, a = generated
    want = torch.tensor(prof["counts"], dtype=torch.float64) / prof["tokens"]
    got = a.double().mean(0)
    assert a.any() and not a.all()
    assert torch.corrcoef(torch.stack([got, want]))[0, 1] > 0.8          # 0.87: 16 sequences, sticky
    # the skew carries over: the busiest 10% of neurons hold about the profile's share of pairs
    share = lambda r: float(r.sort(descending=True).values[:51].sum() / r.sum())  # noqa: E731
    assert share(got) == pytest.approx(share(want), abs=0.08)
    # one shift of all thresholds on the sample: the density is the profile's (ties aside)
    assert got.mean().item() == pytest.approx(prof["density"], rel=0.01)


def test_dead_neurons_never_fire_and_the_rest_do(generated):
    prof, p, a = generated
    dead = torch.tensor(prof["counts"]) == 0
    assert 0 < int(dead.sum()) < 512
    assert not a[:, dead].any()
    assert (p["w_gate"][dead, 1:] == 0).all() and (p["w_gate"][dead, 0] < 0).all()
    assert a[:, ~dead].any(0).double().mean() > 0.9       # live ones fire (the rarest may miss a sample)


def test_early_positions_are_denser_as_in_the_profile(generated):
    prof, p, a = generated
    by_pos = a.reshape(-1, SEQ, 512).double().mean((0, 2))
    early, late = by_pos[:4].mean().item(), by_pos[128:].mean().item()
    want = (POS_F[0] + POS_F[1] + 2 * POS_F[2]) / 4 / POS_F[-1]              # 4.2
    assert early / late == pytest.approx(want, rel=0.3)


def test_activity_is_sticky_within_a_sequence(generated):
    prof, p, a = generated
    got1, got64 = p_next(a, 1), p_next(a, 64)
    indep = prof["lag"]["p_independent"]
    assert got1 > 5 * indep and got64 > 2 * indep
    assert got1 == pytest.approx(prof["lag"]["p_next"][0], rel=0.3)
    assert got1 > got64                                      # it decays with the lag, as the profile's
    # shuffling the positions inside each sequence removes it: the stickiness is the order's
    perm = torch.randperm(SEQ, generator=torch.Generator().manual_seed(0))
    shuffled = a.reshape(-1, SEQ, 512)[:, perm].reshape(-1, 512)
    assert p_next(shuffled, 1, start=0) < 0.6 * p_next(a, 1, start=0)


def test_hot_neurons_are_stickier_as_the_groups_say():
    prof = activity_layer(stick=0.6)
    p = make_ffn_activity(16 * SEQ, 96, 512, prof, seq=SEQ, dtype=torch.float32, device="cpu", seed=1)
    a = activity(p)
    counts = torch.tensor(prof["counts"])
    live = (counts > 0).nonzero().flatten()
    order = live[counts[live].argsort(stable=True)]
    cold, hot = order[:len(order) // 4], order[-len(order) // 4:]
    assert p_next(a[:, hot], 1) > 2 * p_next(a[:, cold], 1)


def test_pooled_lag_statistics_alone_still_give_stickiness():
    prof = activity_layer(groups=False)
    p = make_ffn_activity(8 * SEQ, 96, 512, prof, seq=SEQ, dtype=torch.float32, device="cpu", seed=2)
    assert p_next(activity(p), 1) > 5 * prof["lag"]["p_independent"]


def test_activity_generator_is_deterministic_per_seed():
    prof = activity_layer()
    make = lambda seed: make_ffn_activity(2 * SEQ, 64, 256, prof, seq=SEQ, device="cpu", seed=seed)  # noqa: E731
    a, b, c = make(3), make(3), make(4)
    assert a.keys() == b.keys() == set(make_ffn(4, 8, 8, 0.1, device="cpu"))
    for key in ("x", "w_gate", "w_up", "w_down"):
        assert a[key].dtype == torch.bfloat16 and torch.equal(a[key], b[key])
    assert a["b_gate"] is None and a["b_up"] is None and a["b_down"] is None
    assert not torch.equal(a["x"], c["x"])
    assert not torch.equal(activity(a), activity(c))


@pytest.mark.parametrize("n", [256, 1536])
def test_another_neuron_count_resamples_the_rates(n):
    prof = activity_layer()
    p = make_ffn_activity(8 * SEQ, 96, n, prof, seq=SEQ, dtype=torch.float32, device="cpu", seed=7)
    a = activity(p)
    assert a.shape == (8 * SEQ, n)
    assert a.double().mean().item() == pytest.approx(prof["density"], rel=0.02)
    dead = (p["w_gate"][:, 1:] == 0).all(1)
    assert dead.double().mean().item() == pytest.approx(prof["dead_frac"], abs=1.5 / n)
    assert not a[:, dead].any()
    # the rates drawn for the n neurons keep the profile's spread (the sample's counts add the
    # draws' luck on top: test_activity_generator_reproduces_the_neuron_rates)
    rates = activity_plan(8 * SEQ, n, prof, seq=SEQ, seed=7)["rates"]
    assert ((rates == 0) == dead).all()
    want = torch.tensor(prof["counts"], dtype=torch.float64) / prof["tokens"]
    top = lambda r: float(r.sort(descending=True).values[:len(r) // 10].sum() / r.sum())  # noqa: E731
    assert top(rates) == pytest.approx(top(want), abs=0.02)
    assert rates.mean().item() == pytest.approx(prof["density"], rel=1e-6)


def test_bf16_inputs_keep_the_density():
    # the thresholds are rounded to bf16 with the rest of W_gate: a few % at most
    prof = activity_layer()
    p = make_ffn_activity(8 * SEQ, 128, 512, prof, seq=SEQ, device="cpu", seed=9)
    assert p["x"].dtype == torch.bfloat16 and (p["x"][:, 0] == 1).all()
    assert activity(p).double().mean().item() == pytest.approx(prof["density"], rel=0.05)


def test_a_short_sequence_and_few_tokens_still_work():
    prof = activity_layer()
    for m, seq in ((1, 2048), (37, 16), (300, 64)):
        p = make_ffn_activity(m, 16, 64, prof, seq=seq, dtype=torch.float32, device="cpu", seed=1)
        assert p["x"].shape == (m, 16) and torch.isfinite(p["x"]).all() and torch.isfinite(p["w_gate"]).all()
    ungated = make_ffn_activity(300, 16, 64, prof, seq=64, gated=False, dtype=torch.float32, device="cpu")
    assert ungated["w_up"] is None and ungated["w_down"].shape == (16, 64)


def test_activity_inputs_errors_are_named():
    prof = activity_layer()
    with pytest.raises(ValueError, match="k must be >= 2"):
        make_ffn_activity(16, 1, 64, prof, device="cpu")
    with pytest.raises(ValueError, match="m, n and seq"):
        make_ffn_activity(0, 16, 64, prof, device="cpu")
    with pytest.raises(ValueError, match="m, n and seq"):
        make_ffn_activity(16, 16, 64, prof, seq=0, device="cpu")
    for key, value, match in (("counts", [1, 2, 3], "3 entries for 512"), ("counts", [10 ** 9] * 512, r"\[0, tokens"),
                              ("counts", [0] * 512, "no neuron ever fires"), ("density", 0.0, "density"),
                              ("position", dict(edges=[0, 1], density=[0.1, 0.2]), "position"),
                              ("lag", {"lags": [1], "p_next": []}, "lag")):
        with pytest.raises(ValueError, match=match):
            make_ffn_activity(16, 16, 512, dict(prof, **{key: value}), device="cpu")
    with pytest.raises(ValueError, match="missing"):
        check_activity_layer({k: v for k, v in prof.items() if k != "counts"})


@pytest.fixture
def activity_path(tmp_path):
    path = tmp_path / "activity.json"
    path.write_text(json.dumps(dict(format=ACTIVITY_FORMAT, layers={
        "model.layers.0.mlp": activity_layer(seed=1), "model.layers.1.mlp": activity_layer(dead=0.3, seed=2)})))
    return path


def test_activity_profile_loads_by_name_index_and_sparsest(activity_path):
    name, layer = load_activity_profile(str(activity_path))
    layers = json.loads(activity_path.read_text())["layers"]
    assert name == min(layers, key=lambda k: layers[k]["density"])           # the sparsest by default
    assert layer == layers[name]
    assert load_activity_profile(str(activity_path), "0")[0] == "model.layers.0.mlp"
    assert load_activity_profile(str(activity_path), "model.layers.1.mlp")[1] == layers["model.layers.1.mlp"]


def test_bad_activity_profiles_are_named(activity_path, tmp_path, profile_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_activity_profile(str(tmp_path / "missing.json"))
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_activity_profile(str(tmp_path / "junk.json"))
    with pytest.raises(ValueError, match="format None"):                     # an nnz profile
        load_activity_profile(str(profile_path))
    with pytest.raises(ValueError, match="not in"):
        load_activity_profile(str(activity_path), "model.layers.7.mlp")
    (tmp_path / "empty.json").write_text(json.dumps(dict(format=ACTIVITY_FORMAT, layers={})))
    with pytest.raises(ValueError, match="no layers"):
        load_activity_profile(str(tmp_path / "empty.json"))
    broken = json.loads(activity_path.read_text())
    del broken["layers"]["model.layers.0.mlp"]["lag"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(ValueError, match=r"missing \['lag'\]"):
        load_activity_profile(str(tmp_path / "broken.json"), "0")


@pytest.mark.parametrize("name", ["cpu_tiny_activity.json", "h100_activity.json"])
def test_committed_activity_profiles_generate_their_density(name):
    path = PROFILES / name
    if not path.exists():
        pytest.skip(f"{name} not committed yet")
    data = json.loads(path.read_text())
    assert data["format"] == ACTIVITY_FORMAT and path.stat().st_size < 300_000
    for layer in data["layers"]:
        _, prof = load_activity_profile(str(path), layer)
        assert load_profile(str(path), layer)[1] == prof        # the nnz-profile keys are there too
        n = prof["hidden"]
        p = make_ffn_activity(prof["seq"], 64, n, prof, seq=prof["seq"], dtype=torch.float32, device="cpu", seed=1)
        a = activity(p)
        assert a.double().mean().item() == pytest.approx(prof["density"], rel=0.01)
        assert not a[:, torch.tensor(prof["counts"]) == 0].any()


def _checkpoint(path, tokens=100, k=16, n=24, bias=True, **extra):
    g = torch.Generator().manual_seed(0)
    ck = dict(format=CHECKPOINT_FORMAT, layer="model.layers.1.mlp", seq=50, density=0.1,
              x=torch.randn(tokens, k, generator=g).bfloat16(), w_gate=torch.randn(n, k, generator=g).bfloat16(),
              w_up=torch.randn(n, k, generator=g).bfloat16(), w_down=torch.randn(k, n, generator=g).bfloat16(),
              b_gate=torch.randn(n, generator=g) if bias else None, b_up=torch.randn(n, generator=g) if bias else None,
              b_down=torch.randn(k, generator=g) if bias else None)
    ck.update(extra)
    torch.save(ck, path)
    return ck


@pytest.mark.parametrize("m", [1, 60, 100, 250])
def test_checkpoint_tokens_are_tiled_or_cut_to_m(tmp_path, m):
    ck = _checkpoint(tmp_path / "ck.pt")
    p = load_checkpoint_ffn(str(tmp_path / "ck.pt"), m, "cpu", torch.float32)
    assert set(p) == set(make_ffn(4, 8, 8, 0.1, device="cpu"))
    assert p["x"].shape == (m, 16) and p["x"].dtype == torch.float32
    rows = torch.arange(m) % 100
    assert torch.equal(p["x"], ck["x"].float()[rows])
    for key in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"):
        assert torch.equal(p[key], ck[key].float())


def test_checkpoint_without_biases_and_bad_checkpoints(tmp_path):
    _checkpoint(tmp_path / "nb.pt", bias=False)
    p = load_checkpoint_ffn(str(tmp_path / "nb.pt"), 8, "cpu")
    assert p["b_gate"] is None and p["x"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="cannot read"):
        load_checkpoint_ffn(str(tmp_path / "missing.pt"), 8, "cpu")
    (tmp_path / "junk.pt").write_text("junk")
    with pytest.raises(ValueError, match="not a torch.save file"):
        load_checkpoint_ffn(str(tmp_path / "junk.pt"), 8, "cpu")
    _checkpoint(tmp_path / "fmt.pt", format="other")
    with pytest.raises(ValueError, match="format 'other'"):
        load_checkpoint_ffn(str(tmp_path / "fmt.pt"), 8, "cpu")
    _checkpoint(tmp_path / "shape.pt", w_down=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="do not make an FFN"):
        load_checkpoint_ffn(str(tmp_path / "shape.pt"), 8, "cpu")
    with pytest.raises(ValueError, match="m must be"):
        load_checkpoint_ffn(str(tmp_path / "nb.pt"), 0, "cpu")


def test_activity_specs_parse_and_build_their_inputs(tmp_path, activity_path):
    assert parse_activity("iid") == ("iid", None, None)
    assert parse_activity("a/b.json") == ("profile", "a/b.json", None)
    assert parse_activity("a/b.json:model.layers.3.mlp") == ("profile", "a/b.json", "model.layers.3.mlp")
    assert parse_activity("checkpoint:/tmp/c.pt") == ("checkpoint", "/tmp/c.pt", None)
    for bad in ("", "idd", "a/b.txt:3", "checkpoint:", "a/b.json:"):
        with pytest.raises(ValueError, match="--activity"):
            parse_activity(bad)
    # iid is make_ffn's bits; a profile make_ffn_activity's at its sequence length; a checkpoint its FFN
    iid = make_ffn_for("iid", 32, 16, 64, 0.05, 0.2, device="cpu", seed=4)
    assert torch.equal(iid["x"], make_ffn(32, 16, 64, 0.05, 0.2, device="cpu", seed=4)["x"])
    spec = f"{activity_path}:model.layers.0.mlp"
    prof = load_activity_profile(str(activity_path), "0")[1]
    got = make_ffn_for(spec, 300, 16, 64, 0.05, device="cpu", seed=4)
    want = make_ffn_activity(300, 16, 64, prof, seq=prof["seq"], device="cpu", seed=4)
    assert all(torch.equal(got[key], want[key]) for key in ("x", "w_gate", "w_up", "w_down"))
    _checkpoint(tmp_path / "ck.pt")
    assert make_ffn_for(f"checkpoint:{tmp_path / 'ck.pt'}", 30, 16, 24, 0.1, device="cpu")["x"].shape == (30, 16)
    with pytest.raises(ValueError, match="not 32x24"):
        make_ffn_for(f"checkpoint:{tmp_path / 'ck.pt'}", 30, 32, 24, 0.1, device="cpu")
