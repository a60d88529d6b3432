"""Measure a per-neuron activity profile of a trained sparse model (the input of
twell_compile.testing.make_ffn_activity), and optionally save one layer's real FFN inputs.

    python3 benchmarks/activity_profile.py --layers 4 --batch 8 --seq 2048 --density 0.005 \
        --twell-opt twell.l1=12 --steps 12 --out benchmarks/profiles/h100_activity.json \
        --checkpoint-out /tmp/ckpt.pt       # the GPU profile: 23 s in the script on an H100
                                            # (--check 65536: then the generator against it)
    python3 benchmarks/activity_profile.py --tiny --device cpu --batch 8 --seq 256 --density 0.05 \
        --twell-opt twell.l1=12 --steps 8 --tokens 2048 \
        --out benchmarks/profiles/cpu_tiny_activity.json   # the tests' CPU fixture (~1 min)

The model is bench_e2e.py's (its flags: --tiny, --layers, --hidden, --ffn, --batch, --seq,
--density, --twell-opt, --lr, --seed, ...): random weights, gate biases calibrated to --density,
then --steps AdamW steps on one fixed batch under torch.compile(backend="twell") with its
--twell-opt options (twell.l1=12: the paper's L1 penalty), as profile_train_step.py trains it.
The profile is then measured eagerly (a forward hook on every gate_proj, model.model only: no
logits) on --tokens tokens, --tokens // --seq sequences of --seq tokens: --measure train (the
default) the training batch, extended by fresh sequences past --batch, as
profile_train_step.py --neurons measures it (the H100 run above gives its table in
docs/training-design.md within a few %); --measure fresh unseen tokens (after 12 steps on one
batch of random tokens the model has memorized it: layers 1-3 then read 38-62% dead neurons
and lag-1 P(next | active) 0.72-0.88, against 0.6-4.7% and 0.27-0.44 on the training batch).
--checkpoint-out saves one layer's (--layer: index or name, default the sparsest) FFN inputs
x [tokens, hidden] (bf16, gate_proj's input) with its gate/up/down weights (bf16) and biases
(fp32), and its density on x, for bench_ffn.py --activity checkpoint:PATH
(twell_compile.testing.load_checkpoint_ffn): 136 MB at the default size.

Profile file (JSON, "format": "twell-activity/1"; ~25 KB per layer at 5632 neurons): the run's
"model", "train" and "env", and "layers": {"model.layers.<i>.mlp": {...}}, each self-contained:
    hidden, tokens, mean, density, quantiles, hist_values, hist_counts
        as examples/train_sparse_lm.py --profile-out writes them (neurons, tokens measured, mean
        non-zeros per token, its fraction, the per-token count's quantiles and histogram), so
        testing.load_profile / bench_ffn.py --nnz-profile read this file too
    seq, sequences       the measured batch's shape (tokens = seq * sequences)
    counts               tokens on which each neuron fired (relu(gate) > 0), in neuron order:
                         rate_j = counts[j] / tokens, exact
    dead_frac            fraction of neurons that never fired
    position             {"edges": [0, 1, 2, 4, ..., seq], "density": [...]}: the density of
                         the tokens at positions [edges[i], edges[i+1]) of their sequence
    lag                  {"from": 16, "lags": [1, 2, 4, ...], "p_next": [...],
                         "p_independent": ...}: over positions t >= from, P(neuron active at
                         t + lag | active at t), pooled over neurons (sum of co-active pairs /
                         sum of active), and what it would be with independent tokens
                         (sum r_j^2 / sum r_j, r_j the neuron's rate over those positions)
    lag_by_rate          {"rate": [...], "p_next": [[...], ...]}: the live neurons sorted by rate
                         (stable) in 8 groups of equal size (torch.chunk), each group's mean rate
                         and its pooled P(next | active) at each of lag's lags
    token_cv             std / mean of the per-token count over positions >= lag["from"]
    coactivation         {"top_k": 64, "mean_corr_top": ..., "mean_corr_random": ...}: mean
                         pairwise correlation (over tokens) of the activity of the top_k busiest
                         neurons, and of top_k live neurons drawn at random
    skew                 {"top1_share", "top10_share", "max_over_mean"}: pairs held by the
                         busiest 1% / 10% of neurons, busiest neuron's tokens over the mean
All statistics are computed on the device, vectorized over tokens and neurons (a loop over the
9 lags only). make_ffn_activity reproduces all but the co-activation (H100 profile: mean_corr_top
0.004-0.018, at most 0.016 over the random neurons': left out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

if __package__ in (None, ""):                  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_e2e  # noqa: E402
from twell_compile.testing import ACTIVITY_FORMAT, CHECKPOINT_FORMAT, make_ffn_activity  # noqa: E402

LAG_FROM = 16         # lag statistics skip the first positions: the position profile covers them
LAGS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOP_K = 64
RATE_GROUPS = 8
QUANTILES = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0)


def layer_name(i: int) -> str:
    return f"model.layers.{i}.mlp"


def position_edges(seq: int) -> list[int]:
    edges = [0]
    while edges[-1] < seq:
        edges.append(min(seq, max(1, 2 * edges[-1])))
    return edges


def layer_profile(act: torch.Tensor, seed: int = 0) -> dict[str, Any]:
    """The statistics of one layer's activity ``act`` [sequences, seq, neurons] (bool)."""
    b, s, n = act.shape
    t = b * s
    dev = act.device
    counts = act.sum((0, 1))                                   # [n] int64
    per_token = act.sum(-1).reshape(-1).double()               # [t]
    total = float(counts.sum())
    if total == 0:
        raise ValueError("no neuron fired on any token: nothing to profile")
    vals, freq = per_token.long().unique(return_counts=True)
    qs = torch.quantile(per_token.cpu(), torch.tensor(QUANTILES, dtype=torch.float64))
    edges = position_edges(s)
    by_pos = act.sum(-1).double().sum(0)                       # [s] active pairs per position
    pos_density = [float(by_pos[lo:hi].sum()) / ((hi - lo) * b * n) for lo, hi in zip(edges, edges[1:])]
    # lags: over positions >= LAG_FROM (all positions when the sequence is shorter); per neuron
    # the tokens active at t and at t + lag, then pooled over all live neurons and by rate group
    start = LAG_FROM if s > 2 * LAG_FROM else 0
    late = act[:, start:]
    r_late = late.sum((0, 1)).double() / (b * (s - start))
    lags = [k for k in LAGS if k < s - start]
    both = torch.zeros(len(lags), n, dtype=torch.float64, device=dev)      # [L, n]
    first = torch.zeros_like(both)
    for i, k in enumerate(lags):
        both[i] = (late[:, :-k] & late[:, k:]).sum((0, 1))
        first[i] = late[:, :-k].sum((0, 1))
    p_next = (both.sum(1) / first.sum(1).clamp_min(1.0)).tolist()
    p_ind = float((r_late ** 2).sum() / r_late.sum().clamp_min(1e-30))
    late_tok = late.sum(-1).double()
    token_cv = float(late_tok.std() / late_tok.mean().clamp_min(1e-30)) if late_tok.numel() > 1 else 0.0
    # by rate: the live neurons sorted by overall rate in RATE_GROUPS groups of equal size
    live = (counts > 0).nonzero().flatten()
    order = live[counts[live].argsort(stable=True)]
    g_rate, g_next = [], []
    for grp in order.chunk(min(RATE_GROUPS, order.numel())):
        g_rate.append(float(counts[grp].double().mean()) / t)
        g_next.append((both[:, grp].sum(1) / first[:, grp].sum(1).clamp_min(1.0)).tolist())
    # co-activation: mean off-diagonal correlation of top_k neurons' activity over tokens
    k = min(TOP_K, live.numel())
    flat = act.reshape(t, n)
    hot = counts.argsort(descending=True)[:k]
    g = torch.Generator().manual_seed(seed)
    rnd = live[torch.randperm(live.numel(), generator=g)[:k].to(dev)]

    def mean_corr(idx: torch.Tensor) -> float:
        a = flat[:, idx].double()
        a = a - a.mean(0)
        sd = a.pow(2).mean(0).sqrt()
        ok = sd > 0
        a, sd = a[:, ok], sd[ok]
        if a.shape[1] < 2:
            return 0.0
        c = (a.T @ a) / t / (sd[:, None] * sd[None, :])
        m = c.shape[0]
        return float((c.sum() - c.diagonal().sum()) / (m * (m - 1)))

    top = counts.double().sort(descending=True).values
    return dict(hidden=n, tokens=t, mean=total / t, density=total / (t * n),
                quantiles={str(q): float(v) for q, v in zip(QUANTILES, qs)},
                hist_values=[int(v) for v in vals.cpu()], hist_counts=[int(c) for c in freq.cpu()],
                seq=s, sequences=b, counts=[int(c) for c in counts.cpu()],
                dead_frac=float((counts == 0).double().mean()),
                position=dict(edges=edges, density=pos_density),
                lag={"from": start, "lags": lags, "p_next": p_next, "p_independent": p_ind},
                lag_by_rate=dict(rate=g_rate, p_next=g_next), token_cv=token_cv,
                coactivation=dict(top_k=k, mean_corr_top=mean_corr(hot), mean_corr_random=mean_corr(rnd)),
                skew=dict(top1_share=float(top[:max(1, n // 100)].sum()) / total,
                          top10_share=float(top[:max(1, n // 10)].sum()) / total,
                          max_over_mean=float(top[0] / top.mean())))


def _forward_chunks(model, ids: torch.Tensor, amp: Callable, chunk: Optional[int], hooks: list) -> None:
    """The model's trunk on ``ids``, ``chunk`` sequences per forward; the hooks removed after."""
    chunk = chunk or ids.shape[0]
    try:
        for i in range(0, ids.shape[0], chunk):
            with amp():
                model.model(input_ids=ids[i:i + chunk], use_cache=False)
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def activity(model, ids: torch.Tensor, amp: Callable = contextlib.nullcontext,
             chunk: Optional[int] = None) -> dict[str, torch.Tensor]:
    """relu(gate_proj(x)) > 0 of every layer on ``ids`` [B, S]: {name: bool [B, S, N]}, from
    forward hooks on each ``model.model.layers[i].mlp.gate_proj`` (eager, ``chunk`` sequences per
    forward)."""
    parts: dict[str, list[torch.Tensor]] = {}
    hooks = [layer.mlp.gate_proj.register_forward_hook(
        lambda _m, _i, out, name=layer_name(i): parts.setdefault(name, []).append(out > 0))
        for i, layer in enumerate(model.model.layers)]
    _forward_chunks(model, ids, amp, chunk, hooks)
    return {name: torch.cat(p) for name, p in parts.items()}


def measure_profile(model, ids: torch.Tensor, amp: Callable = contextlib.nullcontext,
                    chunk: Optional[int] = None, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Per layer the statistics of layer_profile on ``ids`` [B, S] ({name: layer dict})."""
    acts = activity(model, ids, amp, chunk)
    out = {}
    for name in sorted(acts, key=lambda s: int(s.split(".")[2])):
        out[name] = layer_profile(acts.pop(name), seed)
    return out


@torch.no_grad()
def layer_inputs(model, index: int, ids: torch.Tensor, amp: Callable = contextlib.nullcontext,
                 chunk: Optional[int] = None) -> torch.Tensor:
    """The FFN input x [B * S, hidden] of layer ``index`` on ``ids`` (gate_proj's input), bf16."""
    xs: list[torch.Tensor] = []
    gate = model.model.layers[index].mlp.gate_proj
    hook = gate.register_forward_hook(lambda _m, inp, _o: xs.append(inp[0].to(torch.bfloat16)))
    _forward_chunks(model, ids, amp, chunk, [hook])
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in xs])


def save_checkpoint(path: str, model, index: int, x: torch.Tensor, seq: int) -> dict[str, Any]:
    """The layer's FFN: x (bf16), weights (bf16), biases (fp32), and its density on x."""
    mlp = model.model.layers[index].mlp
    lin = {"gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj}
    ck: dict[str, Any] = dict(format=CHECKPOINT_FORMAT, layer=layer_name(index), seq=seq, x=x.cpu())
    for key, mod in lin.items():
        ck[f"w_{key}"] = mod.weight.detach().to("cpu", torch.bfloat16).contiguous()
        ck[f"b_{key}"] = None if mod.bias is None else mod.bias.detach().to("cpu", torch.float32)
    wg = ck["w_gate"].to(x.device, torch.float32)
    bg = None if ck["b_gate"] is None else ck["b_gate"].to(x.device)
    fired = sum(float((torch.nn.functional.linear(x[i:i + 4096].float(), wg, bg) > 0).sum())
                for i in range(0, x.shape[0], 4096))
    ck["density"] = fired / (x.shape[0] * wg.shape[0])
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(ck, path)
    return ck


def check_generator(layers: dict[str, dict[str, Any]], m: int, k: int, device) -> list[dict[str, Any]]:
    """Per layer, make_ffn_activity(m, k, its neurons) on ``device`` against the profile: the
    generation's seconds, and realized vs profile density, lag-1 P(next | active), the busiest
    10%'s share of pairs and the correlation of the rates."""
    rows = []
    for name, p in layers.items():
        n, seq = int(p["hidden"]), min(int(p["seq"]), m)
        sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        ffn = make_ffn_activity(m, k, n, p, seq=int(p["seq"]), device=device, seed=1)
        sync()
        sec = time.perf_counter() - t0
        a = torch.nn.functional.linear(ffn["x"], ffn["w_gate"]) > 0
        start = int(p["lag"]["from"]) if seq > 2 * int(p["lag"]["from"]) else 0
        late = a[:m // seq * seq].reshape(-1, seq, n)[:, start:]
        got = a.double().mean(0).cpu()
        want = torch.tensor(p["counts"], dtype=torch.float64) / int(p["tokens"])
        top = got.sort(descending=True).values
        rows.append(dict(layer=name, seconds=sec, density=float(got.mean()), density_profile=p["density"],
                         lag1=float((late[:, :-1] & late[:, 1:]).sum() / late[:, :-1].sum().clamp_min(1)),
                         lag1_profile=p["lag"]["p_next"][0] if p["lag"]["p_next"] else None,
                         top10_share=float(top[:n // 10].sum() / top.sum()), top10_profile=p["skew"]["top10_share"],
                         rate_corr=float(torch.corrcoef(torch.stack([got, want]))[0, 1])))
        r = rows[-1]
        print(f"  make_ffn_activity({m}, {k}, {n}) {name}: {sec:.2f} s; density {r['density']:.4f} "
              f"(profile {r['density_profile']:.4f}), lag-1 {r['lag1']:.3f} ({r['lag1_profile']:.3f}), busiest 10% "
              f"{r['top10_share']:.1%} ({r['top10_profile']:.1%}), rate correlation {r['rate_corr']:.3f}", flush=True)
    return rows


def dump(profile: dict[str, Any]) -> str:
    """Indented JSON with every list of numbers on one line (a 5632-entry list is ~25 KB, not
    ~50 KB with a line per entry)."""
    text = json.dumps(profile, indent=1)
    return re.sub(r"\[[-\d.eE+,\s]*\]", lambda m: re.sub(r"\s+", "", m.group(0)).replace(",", ", "), text)


def train(a: argparse.Namespace, steps: int, amp: Callable):
    """bench_e2e's model, calibrated to --density, then ``steps`` AdamW steps under twell
    (profile_train_step.py's loop); returns the model (train mode off)."""
    ids = bench_e2e.token_batch(a, a.batch, a.seq, a.seed + 2)
    master, achieved = bench_e2e.calibrated_model(a, amp)
    print(f"calibrated to {a.density[0]}: {[round(d, 4) for d in achieved]}", flush=True)
    if steps == 0:
        return master
    state = bench_e2e.cpu_state(master)
    del master
    model, opt, fwd = bench_e2e.training_setup(a, state, "twell")
    for i in range(steps):
        with amp():
            loss = fwd(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i in (0, steps - 1):
            print(f"step {i + 1}/{steps}: loss {float(loss.detach()):.4f}", flush=True)
    del opt, fwd
    torch._dynamo.reset()
    return model.eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--out", required=True, help="the profile JSON")
    ap.add_argument("--steps", type=int, default=12, help="training steps under twell (0: calibrated only)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens measured (and saved by --checkpoint-out)")
    ap.add_argument("--checkpoint-out", default=None, help="save --layer's FFN inputs and weights here (torch.save)")
    ap.add_argument("--layer", default=None, help="--checkpoint-out's layer: index or name (default the sparsest)")
    ap.add_argument("--check", type=int, default=0, metavar="M",
                    help="then build make_ffn_activity(M, hidden, ffn) per layer and print it against the profile")
    ap.add_argument("--measure", choices=("train", "fresh"), default="train",
                    help="train: the training batch (extended by fresh sequences past --batch); fresh: unseen tokens")
    own, rest = ap.parse_known_args(argv)
    if own.steps < 0 or own.tokens < 1:
        raise ValueError(f"--steps must be >= 0 and --tokens >= 1, got {own.steps}, {own.tokens}")
    a = bench_e2e.parse_args(["--train", *rest])
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.perf_counter()
    model = train(a, own.steps, amp)
    seq = min(a.seq, own.tokens)
    # seed + 2 draws the training batch (its first --batch rows when seq == --seq), seed + 3 a fresh one
    ids = bench_e2e.token_batch(a, max(1, own.tokens // seq), seq, a.seed + (2 if own.measure == "train" else 3))
    layers = measure_profile(model, ids, amp, chunk=a.batch, seed=a.seed)
    import twell_compile

    profile = dict(format=ACTIVITY_FORMAT, source="benchmarks/activity_profile.py",
                   command=" ".join(["python3 benchmarks/activity_profile.py", *(argv if argv is not None
                                                                                 else sys.argv[1:])]),
                   model=dict(layers=a.layers, hidden=a.hidden, ffn=a.ffn, heads=a.heads, vocab=a.vocab),
                   measured_on=own.measure,
                   train=dict(steps=own.steps, batch=a.batch, seq=a.seq, lr=a.lr, density_target=a.density[0],
                              twell_options=a.twell_options, backend="twell"),
                   env=dict(device=torch.cuda.get_device_name(dev) if cuda else "cpu", torch=torch.__version__,
                            twell_compile=getattr(twell_compile, "__version__", "unknown"),
                            time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())),
                   layers=layers)
    Path(own.out).parent.mkdir(parents=True, exist_ok=True)
    Path(own.out).write_text(dump(profile) + "\n")
    for name, p in layers.items():
        lag = p["lag"]
        print(f"  {name}: density {p['density']:.4f}, dead {p['dead_frac']:.1%}, first token "
              f"{p['position']['density'][0]:.4f}, lag-1 P(next|active) {lag['p_next'][0]:.3f} vs "
              f"{lag['p_independent']:.3f} independent, top-{p['coactivation']['top_k']} corr "
              f"{p['coactivation']['mean_corr_top']:.3f} (random {p['coactivation']['mean_corr_random']:.3f}), "
              f"busiest 10% hold {p['skew']['top10_share']:.1%}", flush=True)
    print(f"wrote {own.out} ({Path(own.out).stat().st_size / 1e3:.0f} KB)", flush=True)
    if own.checkpoint_out:
        names = list(layers)
        if own.layer is None:
            index = min(range(len(names)), key=lambda i: layers[names[i]]["density"])
        elif own.layer.isdigit() and int(own.layer) < len(names):
            index = int(own.layer)
        elif own.layer in names:
            index = names.index(own.layer)
        else:
            raise ValueError(f"--layer {own.layer!r}: not an index < {len(names)} nor one of {names}")
        x = layer_inputs(model, index, ids, amp, chunk=a.batch)
        ck = save_checkpoint(own.checkpoint_out, model, index, x, seq)
        print(f"wrote {own.checkpoint_out}: {ck['layer']}, x {tuple(x.shape)}, density {ck['density']:.4f} "
              f"({Path(own.checkpoint_out).stat().st_size / 1e6:.0f} MB)", flush=True)
    print(f"done in {time.perf_counter() - t0:.0f} s")
    if own.check:
        check_generator(layers, own.check, a.hidden, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
