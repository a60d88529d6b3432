"""Test and benchmark inputs: the synthetic sparse FFN of the paper's anchors (one place; tests,
benchmarks and the training benches use it), and the toy models they share (``GatedMLP``,
``PlainMLP``, ``FusedMLP``, ``Block``).

    x  = randn(M, K) * exp(tail * randn(M, 1));  x[:, 0] = 1        # channel 0 acts as a bias
    Wg = randn(N, K) / sqrt(K - 1);  Wg[:, 0] = -Phi^-1(1 - density)
    Wu = randn(N, K) / sqrt(K);      Wd = randn(K, N) / sqrt(N * density)

Drawn in fp32 on ``device`` from a seeded generator, then cast. Phi^-1(1 - density) is
clamped to Phi^-1(1e-6) at density 1.0 (the exact value is -inf: every gate would be +inf).
"""

from __future__ import annotations

import functools
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

ACTIVITY_FORMAT = "twell-activity/1"          # benchmarks/activity_profile.py --out
CHECKPOINT_FORMAT = "twell-ffn-checkpoint/1"  # benchmarks/activity_profile.py --checkpoint-out


def gate_shift(density: float) -> float:
    q = min(max(1.0 - density, 1e-6), 1.0 - 1e-6)
    return -float(torch.special.ndtri(torch.tensor(q, dtype=torch.float64)))


def make_ffn(m: int, k: int, n: int, density: float, tail: float = 0.0, *, gated: bool = True,
             dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
             seed: int = 0) -> dict[str, Tensor | None]:
    """x [M, K], w_gate/w_up [N, K], w_down [K, N] (nn.Linear layout), biases None."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32)

    x = randn(m, k) * torch.exp(tail * randn(m, 1))
    x[:, 0] = 1.0
    wg = randn(n, k) / math.sqrt(k - 1)
    wg[:, 0] = gate_shift(density)
    wu = randn(n, k) / math.sqrt(k) if gated else None
    wd = randn(k, n) / math.sqrt(n * density)
    cast = (lambda t: None if t is None else t.to(dtype))
    return {"x": cast(x), "w_gate": cast(wg), "b_gate": None, "w_up": cast(wu), "b_up": None,
            "w_down": cast(wd), "b_down": None}


def load_profile(path: str, layer: str | None = None) -> tuple[str, dict]:
    """One layer of a non-zeros-per-token profile written by examples/train_sparse_lm.py
    (--profile-out). ``layer=None`` picks the layer with the highest mean density."""
    layers = json.load(open(path))["layers"]
    if layer is None:
        layer = max(layers, key=lambda name: layers[name]["density"])
    if layer not in layers:
        raise ValueError(f"layer {layer!r} not in {path}; it has {sorted(layers)}")
    return layer, layers[layer]


def make_ffn_profile(m: int, k: int, n: int, profile: dict, *, gated: bool = True,
                     dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
                     seed: int = 0) -> dict[str, Tensor | None]:
    """Like ``make_ffn`` but each token's density is drawn from a measured profile.

    Token m gets density d_m = nnz / hidden with nnz drawn from the profile's histogram (the
    fraction carries over to another N). The anchors generator makes the gate pre-activation
    x[m, 0] * Wg[:, 0] + z with z ~ N(0, ~1) and Wg[:, 0] = -Phi^-1(1 - d_ref), so
    x[m, 0] = Phi^-1(d_m) / Wg[:, 0] gives P(gate > 0) = d_m for that token.
    """
    d_ref = max(float(profile["density"]), 1e-6)
    p = make_ffn(m, k, n, d_ref, 0.0, gated=gated, dtype=torch.float32, device=device, seed=seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    counts = torch.tensor(profile["hist_counts"], dtype=torch.float64)
    values = torch.tensor(profile["hist_values"], dtype=torch.float64)
    d_m = values[torch.multinomial(counts, m, replacement=True, generator=g)] / int(profile["hidden"])
    d_m = d_m.clamp(1e-6, 1 - 1e-6)
    x0 = torch.special.ndtri(d_m) / gate_shift(d_ref)
    p["x"][:, 0] = x0.to(device=p["x"].device, dtype=torch.float32)
    return {k_: (None if t is None else t.to(dtype)) for k_, t in p.items()}


# ----------------------------------------------------------------------------- realistic activity
# Per-neuron firing rates, position dependence and within-sequence correlation measured on a trained
# model (benchmarks/activity_profile.py writes the profile and documents its fields).

_LAYER_KEYS = ("hidden", "tokens", "seq", "density", "dead_frac", "counts", "position", "lag", "token_cv")
_CHECKPOINT_KEYS = ("x", "w_gate", "b_gate", "w_up", "b_up", "w_down", "b_down")
LATENT_MAX = 0.95     # at most this share of a neuron's gate noise is shared between tokens


def check_activity_layer(p: dict, where: str = "profile layer") -> None:
    """ValueError naming what is wrong with one layer of an activity profile."""
    if not isinstance(p, dict):
        raise ValueError(f"{where}: a layer is a JSON object, got {type(p).__name__}")
    missing = [key for key in _LAYER_KEYS if key not in p]
    if missing:
        raise ValueError(f"{where}: missing {missing}; not written by benchmarks/activity_profile.py "
                         "(an nnz profile of examples/train_sparse_lm.py has no per-neuron rates)")
    n, t = int(p["hidden"]), int(p["tokens"])
    if n < 1 or t < 1 or int(p["seq"]) < 1:
        raise ValueError(f"{where}: hidden, tokens and seq must be >= 1, got {n}, {t}, {p['seq']}")
    counts = torch.as_tensor(p["counts"], dtype=torch.float64)
    if counts.dim() != 1 or counts.numel() != n:
        raise ValueError(f"{where}: counts has {counts.numel()} entries for {n} neurons")
    if bool((counts < 0).any()) or bool((counts > t).any()):
        raise ValueError(f"{where}: counts must lie in [0, tokens={t}]")
    if float(counts.sum()) == 0:
        raise ValueError(f"{where}: no neuron ever fires")
    if not 0.0 < float(p["density"]) <= 1.0 or not 0.0 <= float(p["dead_frac"]) < 1.0:
        raise ValueError(f"{where}: density must be in (0, 1] and dead_frac in [0, 1), got "
                         f"{p['density']}, {p['dead_frac']}")
    pos, lag = p["position"], p["lag"]
    if len(pos.get("edges", [])) != len(pos.get("density", [])) + 1 or not pos["density"]:
        raise ValueError(f"{where}: position wants edges (one more) and density per bucket")
    if len(lag.get("lags", [])) != len(lag.get("p_next", [])) or "p_independent" not in lag:
        raise ValueError(f"{where}: lag wants lags, p_next (one per lag) and p_independent")


def load_activity_profile(path: str, layer: str | None = None) -> tuple[str, dict]:
    """One layer of a benchmarks/activity_profile.py profile: (name, layer dict). ``layer``: a
    name ("model.layers.3.mlp"), an index ("3"), or None for the sparsest layer."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"activity profile {path!r}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"activity profile {path!r}: not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != ACTIVITY_FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"activity profile {path!r}: format {got!r}, want {ACTIVITY_FORMAT!r} "
                         "(benchmarks/activity_profile.py --out writes it)")
    layers = data.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"activity profile {path!r}: no layers")
    if layer is None:
        layer = min(layers, key=lambda name: float(layers[name].get("density", 1.0)))
    elif layer not in layers and layer.isdigit() and f"model.layers.{layer}.mlp" in layers:
        layer = f"model.layers.{layer}.mlp"
    if layer not in layers:
        raise ValueError(f"layer {layer!r} not in {path}; it has {sorted(layers)}")
    check_activity_layer(layers[layer], f"{path}:{layer}")
    return layer, layers[layer]


def _neuron_rates(p: dict, n: int, g: torch.Generator) -> Tensor:
    """Each neuron's firing rate [n] (float64): the profile's own when it has n neurons, else its
    rate distribution resampled (dead share kept, live rates by quantile, then shuffled)."""
    rates = torch.as_tensor(p["counts"], dtype=torch.float64) / int(p["tokens"])
    if rates.numel() == n:
        return rates
    live = rates[rates > 0].sort().values
    dead = min(int(round(float(p["dead_frac"]) * n)), n - 1)
    q = (torch.arange(n - dead, dtype=torch.float64) + 0.5) / (n - dead) * live.numel() - 0.5
    q = q.clamp(0, live.numel() - 1)
    lo = q.floor().long()
    hi = (lo + 1).clamp(max=live.numel() - 1)
    new = live[lo] + (live[hi] - live[lo]) * (q - lo)
    new = (new * (float(rates.mean()) * n / float(new.sum()))).clamp(max=0.99)
    out = torch.cat([torch.zeros(dead, dtype=torch.float64), new])
    return out[torch.randperm(n, generator=g)]


def _position_factor(p: dict, pos: Tensor) -> Tensor:
    """Density at each position over the profile's mean (positions past its last bucket take
    the last bucket's)."""
    edges = torch.as_tensor(p["position"]["edges"], dtype=torch.float64)
    dens = torch.as_tensor(p["position"]["density"], dtype=torch.float64)
    idx = torch.searchsorted(edges[1:].contiguous(), pos.double(), right=True).clamp(max=dens.numel() - 1)
    return dens[idx] / float(p["density"])


def _fire(b: Tensor, s: Tensor) -> Tensor:
    """P(s z > b), z ~ N(0, 1): b [..., U, 1], s [Q] -> [..., U, Q]."""
    return torch.special.ndtr(-b / s)


def _scale_for(dens: Tensor, grid: Tensor, d: Tensor) -> Tensor:
    """Invert a non-decreasing tabulated D(s) (dens over grid) at d, log-linear."""
    i = torch.searchsorted(dens, d.clamp(float(dens[0]), float(dens[-1])).contiguous()).clamp(1, grid.numel() - 1)
    lo, hi = dens[i - 1], dens[i]
    w = ((d - lo) / (hi - lo).clamp_min(1e-300)).clamp(0, 1)
    return torch.exp(grid[i - 1].log() + w * (grid[i].log() - grid[i - 1].log()))


def _solve_thresholds(rates: Tensor, n: int, d_tok: Tensor, rounds: int = 4) -> tuple[Tensor, Tensor]:
    """Thresholds b [live] and per-token scales s [T] such that mean_t P(s_t z > b_j) = rates_j
    (the live neurons') and (1/n) sum_j P(s_t z > b_j) = d_tok[t] (density over all n neurons),
    z ~ N(0, 1): alternating 1-D solves (b per neuron by bisection against 256 quantiles of the
    tokens' s; s per token from D(s) tabulated on a log grid), 4 rounds."""
    uniq, inv = rates.unique(return_inverse=True)
    wts = torch.bincount(inv, minlength=uniq.numel()).double()
    grid = torch.logspace(-2, 2, 801, dtype=torch.float64)                 # s from 0.01 to 100
    d_q = torch.quantile(d_tok, torch.linspace(0.5 / 256, 1 - 0.5 / 256, 256, dtype=torch.float64))
    b = -torch.special.ndtri(uniq.clamp(1e-9, 0.999))

    def table(b: Tensor) -> Tensor:                                         # D(s) on the grid
        return ((wts[:, None] * _fire(b[:, None], grid)).sum(0) / n).cummax(0).values

    for _ in range(rounds):
        s_q = _scale_for(table(b), grid, d_q)
        lo, hi = torch.full_like(b, -20.0), torch.full_like(b, 200.0)
        for _ in range(60):                                                 # the rate falls as b grows
            mid = (lo + hi) / 2
            high = _fire(mid[:, None], s_q).mean(1) > uniq
            lo, hi = torch.where(high, mid, lo), torch.where(high, hi, mid)
        b = (lo + hi) / 2
    return b[inv], _scale_for(table(b), grid, d_tok)


@functools.lru_cache(maxsize=None)
def _gauss_legendre(k: int) -> tuple[Tensor, Tensor]:
    """Nodes and weights on [-1, 1] (Golub-Welsch)."""
    i = torch.arange(1, k, dtype=torch.float64)
    beta = i / torch.sqrt(4 * i * i - 1)
    val, vec = torch.linalg.eigh(torch.diag(beta, 1) + torch.diag(beta, -1))
    return val, 2 * vec[0] ** 2


def _both_fire(b: Tensor, c: Tensor) -> Tensor:
    """P(z1 > b, z2 > b), (z1, z2) standard normal with correlation c: b [U], c [L] -> [L, U]
    (integral over z1 > b of phi(z1) P(z2 > b | z1), 96-point Gauss-Legendre on [b, b + 9])."""
    x, w = _gauss_legendre(96)
    z = b[None, :, None] + 4.5 * (x + 1)                                    # [1, U, Q]
    c = c[:, None, None]
    cond = torch.special.ndtr((c * z - b[None, :, None]) / torch.sqrt(1 - c * c).clamp_min(1e-6))
    pdf = torch.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    return (pdf * cond * w).sum(-1) * 4.5


def _lag_corr(b: Tensor, wts: Tensor, want: Tensor) -> Tensor:
    """The gate-noise correlation c [L] at which neurons of thresholds b [U] (wts of each) give
    pooled P(active at t + lag | active at t) = want [L] (0 where want is at or under
    independence), by bisection."""
    base = float((wts * torch.special.ndtr(-b)).sum())
    lo, hi = torch.zeros_like(want), torch.full_like(want, 0.999)
    for _ in range(40):                                                     # P(next | active) rises with c
        mid = (lo + hi) / 2
        high = (_both_fire(b, mid) * wts).sum(1) / base > want
        lo, hi = torch.where(high, lo, mid), torch.where(high, mid, hi)
    return (lo + hi) / 2


def _nnls2(c: Tensor, lags: Tensor, phi: float) -> tuple[float, float, float]:
    """(squared error, a, b) of c ~ a + b phi^lag, a, b >= 0, in least squares."""
    basis = torch.stack([torch.ones_like(lags), phi ** lags], 1)
    best = (float((c * c).sum()), 0.0, 0.0)
    for cols in ((0, 1), (0,), (1,)):
        a = basis[:, list(cols)]
        coef = torch.linalg.lstsq(a, c[:, None]).solution.flatten()
        if bool((coef < 0).any()):
            continue
        err = float(((a @ coef) - c).pow(2).sum())
        if err < best[0]:
            full = [0.0, 0.0]
            for j, v in zip(cols, coef.tolist()):
                full[j] = v
            best = (err, full[0], full[1])
    return best


def _thresholds(r: Tensor) -> tuple[Tensor, Tensor]:
    """Unit-normal thresholds of the distinct rates of r and how many neurons have each."""
    uniq, inv = r.unique(return_inverse=True)
    return -torch.special.ndtri(uniq.clamp(1e-9, 0.999)), torch.bincount(inv, minlength=uniq.numel()).double()


def _rate_groups(rates: Tensor, groups: int) -> list[Tensor]:
    """The live neurons sorted by rate (stable), in ``groups`` chunks: activity_profile.py's groups."""
    live = (rates > 0).nonzero().flatten()
    return list(live[rates[live].argsort(stable=True)].chunk(groups))


def _by_log_rate(rates: Tensor, g_rate, values) -> Tensor:
    """values given at the group rates g_rate, linearly interpolated over log(rate) to each
    neuron (clamped at the ends; 0 for dead neurons)."""
    v = torch.as_tensor(values, dtype=torch.float64)
    live = (rates > 0).double()
    if v.numel() == 1:
        return live * float(v[0])
    g_log = torch.as_tensor(g_rate, dtype=torch.float64).clamp_min(1e-12).log()
    x = rates.clamp_min(1e-12).log().clamp(float(g_log[0]), float(g_log[-1]))
    i = torch.searchsorted(g_log.contiguous(), x).clamp(1, v.numel() - 1)
    w = ((x - g_log[i - 1]) / (g_log[i] - g_log[i - 1]).clamp_min(1e-12)).clamp(0, 1)
    return live * (v[i - 1] + w * (v[i] - v[i - 1]))


def _correlation(p: dict, rates: Tensor) -> dict:
    """How each neuron's gate noise correlates along a sequence: {"lags", "phi", "groups"}, each
    group {"rate", "seq", "ar"} (its mean rate, lag correlation seq + ar phi^lag).

    Per profile lag, the correlation that thresholded Gaussians at the profile's rates need for its
    pooled P(active at t + lag | active at t) (_lag_corr); phi from the least-squares fit of those
    by rho_seq + rho_ar phi^lag over a grid of time constants. Then per lag_by_rate group (hot
    neurons are stickier: lag-1 P(next | active) 0.55 against 0.01 for the coldest in the H100
    profile's layer 3), on these rates' neurons, its correlations fitted at that phi; without
    groups one group of all live neurons takes the pooled statistic."""
    lags = torch.as_tensor([int(k) for k in p["lag"]["lags"]], dtype=torch.float64)
    out = dict(lags=lags, phi=0.0, groups=[])
    if not lags.numel():
        return out
    prof = torch.as_tensor(p["counts"], dtype=torch.float64) / int(p["tokens"])
    c = _lag_corr(*_thresholds(prof[prof > 0]), torch.as_tensor(p["lag"]["p_next"], dtype=torch.float64))
    best = (float("inf"), 0.0)
    for tau in torch.logspace(0, 4, 65, dtype=torch.float64):                # time constants 1..10^4 tokens
        fit = _nnls2(c, lags, math.exp(-1.0 / float(tau)))
        if fit[0] < best[0]:
            best = (fit[0], math.exp(-1.0 / float(tau)))
    out["phi"] = phi = best[1]
    by = p.get("lag_by_rate") or {}
    wants = by["p_next"] if by.get("rate") else [p["lag"]["p_next"]]
    for idx, want in zip(_rate_groups(rates, len(wants)), wants):
        want_c = _lag_corr(*_thresholds(rates[idx]), torch.as_tensor(want, dtype=torch.float64))
        grp = dict(rate=float(rates[idx].mean()))
        grp["seq"], grp["ar"] = _fit_shares(want_c, lags, phi)
        out["groups"].append(grp)
    return out


def _fit_shares(c: Tensor, lags: Tensor, phi: float) -> tuple[float, float]:
    _, a, b = _nnls2(c, lags, phi)
    scale = min(1.0, LATENT_MAX / max(a + b, 1e-12))
    return a * scale, b * scale


def _shares(corr: dict, rates: Tensor) -> tuple[Tensor, Tensor]:
    """Each neuron's (seq, ar) from its rate group's, interpolated over log(rate)."""
    groups = corr["groups"]
    if not groups:
        zero = torch.zeros_like(rates)
        return zero, zero.clone()
    g_rate = [grp["rate"] for grp in groups]
    return (_by_log_rate(rates, g_rate, [grp["seq"] for grp in groups]),
            _by_log_rate(rates, g_rate, [grp["ar"] for grp in groups]))


def _ar1(g: torch.Generator, shape: tuple[int, int, int], phi: float, device) -> Tensor:
    """Stationary AR(1) along dim 1 with unit variance: a_0 = e_0, a_t = phi a_(t-1) +
    sqrt(1 - phi^2) e_t, by a doubling scan (log2(length) steps, no loop over positions)."""
    y = torch.randn(*shape, generator=g, device=device, dtype=torch.float32)
    y[:, 1:] *= math.sqrt(max(1.0 - phi * phi, 0.0))
    d = 1
    while d < shape[1] and phi ** d > 1e-7:
        y = torch.cat([y[:, :d], y[:, d:] + (phi ** d) * y[:, :-d]], 1)
        d *= 2
    return y


def _shift(x: Tensor, w: Tensor, b: Tensor, fire: int, chunk: int = 1024) -> float:
    """delta such that exactly ``fire`` of the (token, neuron) pairs have x @ w[j] > b_j + delta
    (ties aside): the midpoint of the fire-th and (fire + 1)-th largest x @ w[j] - b_j over all
    pairs, neurons in chunks."""
    top = None
    for i in range(0, w.shape[0], chunk):
        v = ((x @ w[i:i + chunk].T) - b[i:i + chunk]).flatten()
        v = v.topk(min(fire + 1, v.numel())).values
        top = v if top is None else torch.cat([top, v]).topk(min(fire + 1, top.numel() + v.numel())).values
    if fire >= top.numel():
        return float(top[-1]) - 1.0
    return float(top[fire]) + 1.0 if fire == 0 else float(top[fire - 1] + top[fire]) / 2


def activity_plan(m: int, n: int, profile_layer: dict, *, seq: int = 2048, seed: int = 0) -> dict:
    """The generator's parameters for make_ffn_activity (CPU, float64): rates [n], thresholds b
    [n] (dead neurons: NaN), per-token scales s [m], positions [m], and how gate noise correlates
    along a sequence by rate group (corr: _correlation)."""
    check_activity_layer(profile_layer)
    if m < 1 or n < 1 or seq < 1:
        raise ValueError(f"m, n and seq must be >= 1, got {m}, {n}, {seq}")
    p = profile_layer
    g = torch.Generator().manual_seed(seed + 1)
    rates = _neuron_rates(p, n, g).clamp(max=0.99)
    live = rates > 0
    pos = torch.arange(m) % seq
    f = _position_factor(p, pos)
    # per-token spread beyond positions and independent neurons: lognormal, its variance the
    # profile's token_cv^2 less the binomial and position parts (over positions >= lag["from"])
    late = pos >= int(p["lag"].get("from", 0))
    r = rates[live]
    mu = float(r.sum())
    cv_bin2 = float((r * (1 - r)).sum()) / mu ** 2
    f_late = f[late] if bool(late.any()) else f
    cv_pos2 = float(f_late.var(unbiased=False) / f_late.mean() ** 2) if f_late.numel() > 1 else 0.0
    sigma2 = math.log1p(max(0.0, float(p["token_cv"]) ** 2 - cv_bin2 - cv_pos2))
    jitter = torch.exp(math.sqrt(sigma2) * torch.randn(m, generator=g, dtype=torch.float64) - sigma2 / 2)
    d_tok = f * jitter
    density = float(rates.mean())
    d_tok = (d_tok * (density / float(d_tok.mean()))).clamp(1e-7, 0.45 * float(live.double().mean()))
    b_live, s = _solve_thresholds(r, n, d_tok)
    b = torch.full((n,), float("nan"), dtype=torch.float64)
    b[live] = b_live
    return dict(rates=rates, b=b, s=s, positions=pos, corr=_correlation(p, rates), density=density)


def make_ffn_activity(m: int, k: int, n: int, profile_layer: dict, *, seq: int = 2048, gated: bool = True,
                      dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
                      seed: int = 0) -> dict[str, Tensor | None]:
    """Like ``make_ffn`` but with a trained layer's activity (benchmarks/activity_profile.py):
    neuron j fires on about its profile rate of the tokens (the profile's rates when it has n
    neurons, else its rate distribution resampled), dead neurons never, tokens early in each
    sequence of ``seq`` tokens (token i sits at position i % seq) denser as the profile's
    position buckets say, with the profile's per-token spread, and a neuron active at one
    position is likely active at the next as the profile's lag statistics say. The realized
    density is the profile's (one shift of all thresholds on the drawn sample). The recipe, as
    make_ffn's with x[:, 0] = 1 the bias channel:

        pre[t, j] = -b_j + s_t * (x~[t] . w_j)            (W_gate[j] = (-b_j, w_j))
        x~[t] = (u_seq(t), a_t, e_t)                      channels 1..K-1 in three parts
        w_j = (sqrt(seq_j) g1, sqrt(ar_j) g2, sqrt(1 - seq_j - ar_j) g3)

    u is one draw per sequence, a an AR(1) along it (phi), e one draw per token, each part of
    each row scaled to norm sqrt(its channels) (an RMSNorm's output), g1..g3 random unit
    vectors: a neuron's gate noise is N(0, s_t^2) with lag correlation seq_j + ar_j phi^lag
    (_correlation fits seq, ar by rate group, phi once). s_t sets token t's density and b_j the
    neuron's rate, solved together (_solve_thresholds). u and a are centred over the sequences
    (each neuron's offsets sum to 0), which keeps a neuron's count near its rate with few
    sequences. Dead neurons: W_gate[j] = (-1, 0, ..., 0). W_up and W_down as make_ffn's at the
    profile's density; biases None.

    Against benchmarks/profiles/h100_activity.json (activity_profile.py --check 65536: M=65536,
    2048x5632, 0.3-0.5 s on an H200): density exact in all 4 layers, lag-1 P(next | active)
    0.215-0.418 for 0.225-0.449, the busiest 10% of neurons' share of pairs 29.5-52.5% for
    27.5-50.7%, realized rates correlating 0.91-0.96 with the profile's. With 8 sequences (M=16384,
    layer 3, CPU): position buckets within 10%, lag 256 0.13 (0.16), per-token count CV 0.49
    (0.48), rates correlating 0.83: the draws of few sequences move each neuron's count (as a
    real model's), which widens the skew (58% for 51%). Calibrating every neuron on the sample
    instead (exact counts) cut lag-1 to 0.33 for 0.44."""
    if k < 2:
        raise ValueError(f"k must be >= 2 (channel 0 is the bias channel), got {k}")
    plan = activity_plan(m, n, profile_layer, seq=seq, seed=seed)
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32)

    # channels 1..K-1 in three parts: constant over a sequence, AR(1) along it, per token
    third = (k - 1) // 3
    cuts = (0, third, 2 * third, k - 1)
    dead = torch.isnan(plan["b"]).to(device)
    w = randn(n, k - 1)
    parts = [torch.nn.functional.normalize(w[:, lo:hi], dim=1) for lo, hi in zip(cuts, cuts[1:])]
    density = max(plan["density"], 1e-6)
    wu = randn(n, k) / math.sqrt(k) if gated else None
    wd = randn(k, n) / math.sqrt(n * density)
    length = min(seq, m)
    nseq = -(-m // length)
    x = randn(nseq, length, k - 1)
    if third:
        u = randn(nseq, 1, third)
        if nseq > 1:   # centred over the sequences: each neuron's offsets sum to 0, less luck in its count
            u = (u - u.mean(0)) * math.sqrt(nseq / (nseq - 1))
        x[:, :, :third] = u
        a = _ar1(g, (nseq, length, third), plan["corr"]["phi"], device)
        if nseq > 1:
            a = (a - a.mean(0)) * math.sqrt(nseq / (nseq - 1))
        x[:, :, third:2 * third] = a
    # every row's parts to norm sqrt(channels), as after an RMSNorm: a token's gate noise over the
    # neurons is then N(0, s_t^2) exactly; unnormalized, the 3% spread of |x| at K=2048 moved the
    # count of a threshold near 3 sd by ~25%
    x = x.reshape(nseq * length, k - 1)[:m]
    for lo, hi in zip(cuts, cuts[1:]):
        part = x[:, lo:hi]
        if hi > lo:
            part.mul_(math.sqrt(part.shape[1]) / part.norm(dim=1, keepdim=True).clamp_min(1e-12))
    x = x * plan["s"].to(device=device, dtype=torch.float32)[:, None]
    x = torch.cat([torch.ones(m, 1, device=device), x], 1)
    cast = (lambda t: None if t is None else t.to(dtype))
    # W_gate[:, 1:]: neuron j's unit-norm row, its parts weighted by the square roots of its
    # rate group's shares of sequence-constant, AR(1) and per-token noise
    seq_share, ar_share = _shares(plan["corr"], plan["rates"])
    share = torch.stack([seq_share, ar_share]).to(device=device, dtype=torch.float32) * (third > 0)
    share = torch.cat([share, (1 - share.sum(0, keepdim=True)).clamp_min(0)]).sqrt()
    wn = torch.cat([share[i][:, None] * parts[i] for i in range(3)], 1).masked_fill(dead[:, None], 0.0)
    # thresholds: the solved b_j (the rate of neuron j in expectation over sequences: its count in
    # one sample varies with the sequences' draws, as a real model's does) plus one shift for all
    # neurons that makes this sample's density exact (up to the rounding of -b_j to dtype).
    # Calibrating each neuron on the sample instead cut the stickiness: lag-1 P(next | active)
    # 0.48 for 0.55 in the H100 profile's hottest group, 0.12 for 0.25 at lag 256
    b = plan["b"].to(device=device, dtype=torch.float32).nan_to_num(0.0)
    live = ~dead
    fire = int(round(plan["density"] * m * n))
    b = b + _shift(cast(x)[:, 1:].float(), cast(wn)[live].float(), b[live], fire)
    wg = torch.cat([torch.where(dead, -1.0, -b)[:, None], wn], 1)
    return {"x": cast(x), "w_gate": cast(wg), "b_gate": None, "w_up": cast(wu), "b_up": None,
            "w_down": cast(wd), "b_down": None}


def load_checkpoint_ffn(path: str, m: int, device: str | torch.device = "cuda",
                        dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor | None]:
    """A layer saved by benchmarks/activity_profile.py --checkpoint-out as make_ffn's dict: its
    real FFN inputs x tiled (or cut) to m rows, its weights and biases."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise ValueError(f"checkpoint {path!r}: cannot read it ({e.strerror})") from None
    except Exception as e:  # noqa: BLE001  (torch.load raises several kinds on a non-checkpoint)
        raise ValueError(f"checkpoint {path!r}: not a torch.save file ({type(e).__name__}: {e})") from None
    if not isinstance(ck, dict) or ck.get("format") != CHECKPOINT_FORMAT:
        got = ck.get("format") if isinstance(ck, dict) else type(ck).__name__
        raise ValueError(f"checkpoint {path!r}: format {got!r}, want {CHECKPOINT_FORMAT!r} "
                         "(benchmarks/activity_profile.py --checkpoint-out writes it)")
    missing = [key for key in _CHECKPOINT_KEYS if key not in ck]
    if missing:
        raise ValueError(f"checkpoint {path!r}: missing {missing}")
    x, wg, wd = ck["x"], ck["w_gate"], ck["w_down"]
    if x.dim() != 2 or wg.shape[1] != x.shape[1] or wd.shape != (x.shape[1], wg.shape[0]):
        raise ValueError(f"checkpoint {path!r}: shapes x {tuple(x.shape)}, w_gate {tuple(wg.shape)}, "
                         f"w_down {tuple(wd.shape)} do not make an FFN")
    x = x.repeat(-(-m // x.shape[0]), 1)[:m]
    out = dict(ck, x=x)
    return {key: (None if out[key] is None else out[key].to(device=device, dtype=dtype).contiguous())
            for key in _CHECKPOINT_KEYS}


def parse_activity(spec: str) -> tuple[str, str | None, str | None]:
    """bench_ffn.py's --activity: "iid" -> ("iid", None, None) (make_ffn);
    "PROFILE.json[:LAYER]" -> ("profile", path, layer or None) (make_ffn_activity);
    "checkpoint:PATH" -> ("checkpoint", path, None) (load_checkpoint_ffn)."""
    if spec == "iid":
        return "iid", None, None
    if spec.startswith("checkpoint:"):
        path = spec[len("checkpoint:"):]
        if not path:
            raise ValueError("--activity checkpoint:PATH wants a path")
        return "checkpoint", path, None
    if spec.endswith(".json"):
        return "profile", spec, None
    path, sep, layer = spec.rpartition(":")
    if sep and path.endswith(".json") and layer:
        return "profile", path, layer
    raise ValueError(f"--activity {spec!r}: want iid, PROFILE.json[:LAYER] or checkpoint:PATH")


def make_ffn_for(activity: str, m: int, k: int, n: int, density: float, tail: float = 0.0, *,
                 gated: bool = True, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cuda", seed: int = 0) -> dict[str, Tensor | None]:
    """One benchmark point's inputs under an --activity spec (parse_activity): make_ffn's for
    "iid", make_ffn_activity's at the profile's own sequence length for a profile (density and
    tail unused), the checkpoint's FFN for "checkpoint:PATH" (it must be K x N)."""
    kind, path, layer = parse_activity(activity)
    if kind == "iid":
        return make_ffn(m, k, n, density, tail, gated=gated, dtype=dtype, device=device, seed=seed)
    if kind == "profile":
        _, prof = load_activity_profile(path, layer)
        return make_ffn_activity(m, k, n, prof, seq=int(prof["seq"]), gated=gated, dtype=dtype, device=device,
                                 seed=seed)
    p = load_checkpoint_ffn(path, m, device, dtype)
    if tuple(p["w_gate"].shape) != (n, k):
        raise ValueError(f"checkpoint {path!r} holds a {p['w_gate'].shape[1]}x{p['w_gate'].shape[0]} FFN, "
                         f"not {k}x{n}")
    return p


# --------------------------------------------------------------------------- toy models
# A ReLU FFN in its three common spellings, a residual block around any of them, and one
# beside a second input. Layer names in reports follow these attribute names (``mlp``; ``gate``,
# ``up``, ``down``, ``gate_up``). A test that needs another spelling (a ReLU module, raw matmuls, an extra user of
# h) defines it beside the test, since that spelling is the point.
class GatedMLP(nn.Module):
    """down(relu(gate(x)) * up(x)), Llama's FFN (without biases unless ``bias``)."""

    def __init__(self, k: int = 16, n: int = 40, bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(k, n, bias=bias)
        self.up = nn.Linear(k, n, bias=bias)
        self.down = nn.Linear(n, k, bias=bias)

    def forward(self, x):
        return self.down(F.relu(self.gate(x)) * self.up(x))

    @classmethod
    def at_density(cls, k: int, n: int, density: float) -> "GatedMLP":
        """Without biases, holding ``make_ffn``'s weights at ``density``
        (fp32 on the CPU: move it with .cuda().to(dtype))."""
        mlp = cls(k, n)
        p = make_ffn(8, k, n, density, 0.0, dtype=torch.float32)
        with torch.no_grad():
            for name in ("gate", "up", "down"):
                getattr(mlp, name).weight.copy_(p[f"w_{name}"])
        return mlp


class PlainMLP(nn.Module):
    """down(relu(gate(x))), the non-gated FFN (its projection named as make_ffn and the ops
    name it)."""

    def __init__(self, k: int = 16, n: int = 40, bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(k, n, bias=bias)
        self.down = nn.Linear(n, k, bias=bias)

    def forward(self, x):
        return self.down(F.relu(self.gate(x)))


class FusedMLP(nn.Module):
    """Phi-3's gated FFN: gate and up one projection, split by chunk."""

    def __init__(self, k: int = 16, n: int = 40, bias: bool = False):
        super().__init__()
        self.gate_up = nn.Linear(k, 2 * n, bias=bias)
        self.down = nn.Linear(n, k, bias=bias)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.relu(g) * u)


class Block(nn.Module):
    """A transformer block's FFN half: x + mlp(norm(x)), LayerNorm over ``k`` features (no norm
    with ``norm=False``)."""

    def __init__(self, mlp: nn.Module, k: int = 16, norm: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(k) if norm else nn.Identity()
        self.mlp = mlp

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class PlusMean(nn.Module):
    """mlp(x) + z.mean(): the FFN's output plus a 0-d value from a second input (which may be of
    another dtype, or change length and so recompile)."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, x, z):
        return self.mlp(x) + z.mean()
