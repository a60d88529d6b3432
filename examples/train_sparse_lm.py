"""Train a Llama-architecture LM with ReLU FFNs from scratch, sparse (L1) or dense, with twell.

The paper's recipe end to end, on a corpus every machine has offline: the Python standard
library's own sources (``sysconfig.get_paths()["stdlib"]``, *.py files, sorted, fixed seed),
split into train and validation *by file*, tokenised with a byte-level BPE tokenizer trained
here with the ``tokenizers`` package (cached). The model is Hugging Face's
``LlamaForCausalLM`` with ``hidden_act="relu"``, compiled with
``torch.compile(model, backend="twell", options={"twell.l1": L1})``: the L1 penalty on the FFN
activations lives in twell's backward, the loss stays plain cross-entropy.

    python examples/train_sparse_lm.py --out runs/sparse                 # CPU tiny, sparse
    python examples/train_sparse_lm.py --out runs/dense --baseline       # same run, L1 = 0
    python examples/plot_training.py runs/sparse runs/dense --out runs/plots
    python examples/train_sparse_lm.py --preset gpu --out runs/gpu_sparse --profile-out nnz.json

Writes under --out: ``metrics.jsonl`` (one JSON object per line, ``kind`` = config | train |
eval | dead | final | bench; docs/training.md explains every field), ``ckpt/step_XXXXXXX/``
(model.safetensors, optim.safetensors, state.json; ``--resume auto`` continues from the latest)
and, with matplotlib installed, PNG plots of this run. The tokenizer and the tokenised corpus
are cached in ``--cache-dir`` (default: ``cache/`` next to --out) and shared between runs.
The last lines printed name every output written and the plot command.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import sysconfig
import time
import zlib
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F

EOS = "<|endoftext|>"

# Every preset field is also a command-line flag (--d-model etc.) that overrides it.
PRESETS: dict[str, dict[str, Any]] = {
    # ~0.6M parameters (0.3M without embeddings); ~3 minutes on a loaded 2-core CPU, tokenizer included.
    "cpu-tiny": dict(corpus_mb=3.0, vocab=2048, d_model=96, layers=4, heads=4, ffn=384, seq=128, batch=8,
                     steps=300, lr=3e-3, warmup=30, l1=3.0, eval_every=50, eval_batches=8, log_every=10,
                     ckpt_every=100, dead_probe_every=25, dead_check_every=100, device="cpu"),
    # ~33M parameters (25M without embeddings): d 512, 8 layers, N 1408 (2.75 d, the paper's ratio).
    # 1500 steps x 16 x 512 tokens = 12.3M tokens: a few minutes on one H100 even on twell's
    # plain-PyTorch training path (estimate in docs/training.md).
    "gpu": dict(corpus_mb=0.0, vocab=8192, d_model=512, layers=8, heads=8, ffn=1408, seq=512, batch=16,
                steps=1500, lr=2e-3, warmup=100, l1=10.0, eval_every=250, eval_batches=16, log_every=25,
                ckpt_every=500, dead_probe_every=50, dead_check_every=250, device="cuda"),
}


# First-step (compile) times measured per preset, shown before the first step: cpu-tiny 15-34 s
# on the 2-core development machine, gpu 15-25 s on the H200 (2026-11-22).
COMPILE_S = {"cpu-tiny": 35, "gpu": 25}


# ----------------------------------------------------------------------------- corpus
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path) -> list[tuple[str, str]]:
    """(relative path, text) of every UTF-8 *.py file under root, sorted by path.

    site-packages (installed third-party code) and __pycache__ are left out, so the corpus is
    the interpreter's own library only.
    """
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        parts = set(rel.split("/"))
        if "site-packages" in parts or "dist-packages" in parts or "__pycache__" in parts:
            continue
        try:
            text = p.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # a handful of test files are deliberately not UTF-8
        if text.strip():
            out.append((rel, text))
    return out


def split_corpus(files: list[tuple[str, str]], corpus_mb: float, val_pct: int, seed: int
                 ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Deterministic subset (corpus_mb > 0: files in a seeded hash order until the budget) and
    a train/validation split by file: a file is validation when hash(seed, path) % 100 < val_pct."""
    def h(rel: str, salt: str) -> int:
        return zlib.crc32(f"{seed}:{salt}:{rel}".encode())

    if corpus_mb > 0:
        budget, chosen = corpus_mb * 1e6, []
        for rel, text in sorted(files, key=lambda f: h(f[0], "subset")):
            if budget <= 0:
                break
            chosen.append((rel, text))
            budget -= len(text.encode())
        files = sorted(chosen)
    val = [f for f in files if h(f[0], "split") % 100 < val_pct]
    train = [f for f in files if h(f[0], "split") % 100 >= val_pct]
    if not val or not train:
        raise SystemExit(f"corpus too small for a split by file: {len(train)} train, {len(val)} val files")
    return train, val


def corpus_key(files: Iterable[tuple[str, str]], *extra: Any) -> str:
    d = hashlib.sha256(repr(extra).encode())
    for rel, text in files:
        d.update(rel.encode() + b"\0" + hashlib.sha256(text.encode()).digest())
    return d.hexdigest()[:16]


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_data(args) -> dict[str, Any]:
    """Tokenizer and token streams (train, val), built once and cached in args.cache_dir."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    root = Path(args.corpus_dir) if args.corpus_dir else stdlib_root()
    files = corpus_files(root)
    train, val = split_corpus(files, args.corpus_mb, args.val_pct, args.seed)
    key = corpus_key(train + val, args.vocab, args.val_pct, args.seed, "v1")
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    tok_path, tok_ids = cache / f"tokenizer-{key}.json", cache / f"tokens-{key}.safetensors"
    if tok_path.exists() and tok_ids.exists():
        tok = Tokenizer.from_file(str(tok_path))
        streams = load_file(str(tok_ids))
    else:
        t0 = time.perf_counter()
        tok = train_tokenizer([t for _, t in train], args.vocab)  # never sees validation files
        eos = tok.token_to_id(EOS)
        streams = {}
        for name, part in (("train", train), ("val", val)):
            ids: list[int] = []
            for enc in tok.encode_batch([t for _, t in part]):
                ids.extend(enc.ids)
                ids.append(eos)
            streams[name] = torch.tensor(ids, dtype=torch.int32)
        tok.save(str(tok_path))
        save_file(streams, str(tok_ids))
        print(f"tokenizer + tokenised corpus built in {time.perf_counter() - t0:.1f} s -> {cache}", file=sys.stderr)
    return dict(tokenizer=tok, train=streams["train"].long(), val=streams["val"].long(), key=key,
                root=str(root), n_train_files=len(train), n_val_files=len(val),
                train_bytes=sum(len(t.encode()) for _, t in train), val_bytes=sum(len(t.encode()) for _, t in val))


def train_batch(stream: torch.Tensor, step: int, batch: int, seq: int, seed: int, stream_id: int = 0) -> torch.Tensor:
    """Windows of seq + 1 tokens at positions drawn from a generator seeded by (seed, step):
    the data order is a function of the step alone, identical across runs and on resume."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 7 + stream_id * 104_729 + 1)
    starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=g)
    return torch.stack([stream[s:s + seq + 1] for s in starts.tolist()])


def val_batches(stream: torch.Tensor, n_batches: int, batch: int, seq: int) -> list[torch.Tensor]:
    """Fixed evenly spaced windows over the validation stream (non-overlapping where it is long enough)."""
    n = n_batches * batch
    stride = max(1, (stream.numel() - seq - 1) // n)
    starts = [min(i * stride, stream.numel() - seq - 1) for i in range(n)]
    w = torch.stack([stream[s:s + seq + 1] for s in starts])
    return list(w.split(batch))


# ----------------------------------------------------------------------------- model
def build_model(args, vocab: int):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=args.d_model, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, hidden_act="relu",
        max_position_embeddings=args.seq, tie_word_embeddings=True, initializer_range=0.02,
        attention_dropout=0.0, use_cache=False)
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    return model


def mlps(model) -> list[tuple[str, Any]]:
    """(layer name as twell reports it, the LlamaMLP module) for every decoder layer."""
    return [(f"model.layers.{i}.mlp", layer.mlp) for i, layer in enumerate(model.model.layers)]


class GateProbe:
    """Forward hooks on each MLP's ReLU (eager model only) collecting h_g = relu(gate(x))."""

    def __init__(self, model):
        self.model = model
        self.out: dict[str, torch.Tensor] = {}

    def __enter__(self):
        self.handles = []
        for name, mlp in mlps(self.model):
            def hook(_mod, _inp, output, name=name):
                self.out[name] = output.detach()
            self.handles.append(mlp.act_fn.register_forward_hook(hook))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def autocast(args):
    if args.device.startswith("cuda") and args.bf16:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def probe_gates(model, x: torch.Tensor, args) -> dict[str, torch.Tensor]:
    """h_g = relu(gate(x)) per layer [B, S, N], from one eager eval-mode forward on x."""
    was = model.training
    model.eval()
    with GateProbe(model) as p, autocast(args):
        model(input_ids=x)
    model.train(was)
    return p.out


def probe_counts(model, x: torch.Tensor, args) -> dict[str, torch.Tensor]:
    """Non-zeros of h_g per token [B, S] per layer."""
    return {k: (v != 0).sum(-1) for k, v in probe_gates(model, x, args).items()}


def probe_fired(model, x: torch.Tensor, args) -> dict[str, torch.Tensor]:
    """Per layer, per neuron: did it fire on any token of x? (bool [N], stays on the device)."""
    return {k: (v != 0).flatten(0, -2).any(0) for k, v in probe_gates(model, x, args).items()}


@torch.no_grad()
def evaluate(model, batches: list[torch.Tensor], args) -> float:
    """Mean cross-entropy over the fixed validation windows, eager forward (no recompiles)."""
    was = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=args.device)
    for w in batches:
        w = w.to(args.device)
        with autocast(args):
            logits = model(input_ids=w[:, :-1]).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten())
    model.train(was)
    return float(total) / len(batches)


def reinit_dead_rows(model, optimizer, dead: dict[str, torch.Tensor], step: int, seed: int) -> None:
    """The paper's re-initialisation of dead gate rows: W <- 0.9 W + 0.1 N(0, 0.02^2), on the
    rows of W_gate (nn.Linear layout [N, K]) whose neuron never fired; their AdamW moments are
    zeroed so the stale statistics do not steer the fresh rows. Nothing else changes."""
    g = torch.Generator(device="cpu").manual_seed(seed * 7_919 + step)
    for name, mlp in mlps(model):
        rows = dead[name].nonzero().flatten()
        if rows.numel() == 0:
            continue
        w = mlp.gate_proj.weight
        noise = (torch.randn(rows.numel(), w.shape[1], generator=g) * 0.02).to(w.device, w.dtype)
        w.data[rows] = 0.9 * w.data[rows] + 0.1 * noise
        state = optimizer.state.get(w, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in state:
                state[k][rows] = 0


# ----------------------------------------------------------------------------- checkpoints
def save_checkpoint(out: Path, step: int, model, optimizer, extra: dict[str, torch.Tensor],
                    state: dict[str, Any], keep: int) -> Path:
    from safetensors.torch import save_file, save_model

    d = out / "ckpt" / f"step_{step:07d}"
    tmp = d.with_name(d.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_model(model, str(tmp / "model.safetensors"))
    names = {p: n for n, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            tensors[f"{names[p]}::{k}"] = v.detach().reshape(v.shape).contiguous().cpu()
    for k, v in extra.items():
        tensors[f"extra::{k}"] = v.detach().contiguous().cpu()
    save_file(tensors, str(tmp / "optim.safetensors"))
    import twell_compile

    controller = twell_compile.controller_state_dict()      # twell.target_density's coefficients
    if controller:
        torch.save(controller, tmp / "controller.pt")
    (tmp / "state.json").write_text(json.dumps(dict(state, step=step), indent=1))
    if d.exists():
        shutil.rmtree(d)
    tmp.rename(d)
    (out / "ckpt" / "latest").write_text(d.name + "\n")
    old = sorted(p for p in (out / "ckpt").glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for p in old[:-keep] if keep > 0 else []:
        shutil.rmtree(p)
    return d


def resolve_resume(resume: str, out: Path) -> Optional[Path]:
    if not resume:
        return None
    if resume == "auto":
        latest = out / "ckpt" / "latest"
        return out / "ckpt" / latest.read_text().strip() if latest.exists() else None
    return Path(resume)


def load_checkpoint(d: Path, model, optimizer=None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Loads weights (and optimizer moments) in place; returns (state.json, extra tensors)."""
    from safetensors.torch import load_file, load_model

    device = next(model.parameters()).device
    load_model(model, str(d / "model.safetensors"), device=str(device))
    tensors = load_file(str(d / "optim.safetensors"), device=str(device))
    extra = {k.split("::", 1)[1]: v for k, v in tensors.items() if k.startswith("extra::")}
    if optimizer is not None:
        params = dict(model.named_parameters())
        for key, v in tensors.items():
            name, k = key.split("::", 1)
            if name == "extra":
                continue
            if k == "step":  # AdamW keeps its step count as a CPU scalar unless capturable/fused
                v = v.cpu()
            optimizer.state[params[name]][k] = v
    if (d / "controller.pt").exists():
        import twell_compile

        twell_compile.load_controller_state_dict(torch.load(d / "controller.pt"))
    return json.loads((d / "state.json").read_text()), extra


# ----------------------------------------------------------------------------- summaries
QUANTILES = [0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0]


def nnz_summary(counts: dict[str, torch.Tensor], hidden: int) -> dict[str, Any]:
    """Per layer: the distribution of non-zeros per token (exact histogram, quantiles, mean) and
    the mean per sequence position, from per-token counts [B, S]."""
    out = {}
    for name, c in counts.items():
        c = c.cpu()
        flat = c.flatten()
        values, freq = torch.unique(flat, return_counts=True)
        q = torch.quantile(flat.double(), torch.tensor(QUANTILES, dtype=torch.float64))
        out[name] = dict(hidden=hidden, tokens=int(flat.numel()), mean=float(flat.double().mean()),
                         density=float(flat.double().mean()) / hidden,
                         quantiles={str(p): float(v) for p, v in zip(QUANTILES, q.tolist())},
                         hist_values=values.tolist(), hist_counts=freq.tolist(),
                         per_position_mean=[round(v, 4) for v in c.double().mean(0).tolist()])
    return out


class Metrics:
    def __init__(self, path: Path, append: bool):
        self.path = path
        self.f = open(path, "a" if append else "w")

    def log(self, kind: str, **rec: Any) -> None:
        self.f.write(json.dumps(dict(kind=kind, **rec)) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


# ----------------------------------------------------------------------------- training
def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def make_optimizer(model, args):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def compile_model(model, args):
    if args.backend == "eager":
        return model
    if args.backend == "inductor":
        if args.l1 or args.target_density:
            raise SystemExit("--l1 and --target-density need --backend twell (the penalty lives in twell's backward)")
        return torch.compile(model, backend="inductor")
    # skip_dense=False: the recipe records every layer's sparsity, the dense baseline's too, so
    # every FFN runs our op (without a penalty the speed rules would leave CPU training FFNs,
    # and CUDA ones under 8192 tokens, to Inductor, which keeps no statistics)
    return torch.compile(model, backend="twell", options=twell_options(args))


def twell_options(args) -> dict[str, Any]:
    """The backend's options: a fixed ``twell.l1``, or with --target-density the controller's
    ``twell.target_density`` (each layer's coefficient adapted to hold that density)."""
    penalty = ({"twell.target_density": float(args.target_density), "twell.target_steps": args.target_steps}
               if args.target_density else {"twell.l1": float(args.l1)})
    return {**penalty, "twell.l1_layers": args.layers, "twell.skip_dense": False}


def train(args) -> dict[str, Any]:
    """Runs the whole recipe; returns a summary (also the last metrics records)."""
    import twell_compile
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    ckpt = resolve_resume(args.resume, out)
    done_before = json.loads((ckpt / "state.json").read_text())["step"] if ckpt is not None else 0
    if done_before >= args.steps:
        # Nothing left to train: no new records, no second final pass (its val_loss would be None).
        return dict(out=str(out), steps=args.steps, last_step=done_before, complete=True,
                    outputs=outputs_of(out, ckpt, args))

    data = load_data(args)
    vocab = data["tokenizer"].get_vocab_size()
    model = build_model(args, vocab).to(args.device)
    optimizer = make_optimizer(model, args)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.model.embed_tokens.weight.numel()

    start, fired = 0, None
    if ckpt is not None:
        state, extra = load_checkpoint(ckpt, model, optimizer)
        start = state["step"]
        fired = {k[len("fired:"):]: v.bool() for k, v in extra.items() if k.startswith("fired:")} or None
        print(f"resumed from {ckpt} at step {start}", file=sys.stderr)
    metrics = Metrics(out / "metrics.jsonl", append=ckpt is not None)
    cfg_rec = {k: v for k, v in vars(args).items()}
    metrics.log("config", step=start, **cfg_rec, params=n_params, params_no_embed=n_params - n_embed,
                vocab_actual=vocab, corpus_root=data["root"], corpus_key=data["key"],
                train_files=data["n_train_files"], val_files=data["n_val_files"], train_bytes=data["train_bytes"],
                val_bytes=data["val_bytes"], train_tokens=int(data["train"].numel()),
                val_tokens=int(data["val"].numel()), python=sys.version.split()[0], torch=torch.__version__,
                resumed_from=str(ckpt) if ckpt else None)

    vals = val_batches(data["val"], args.eval_batches, args.batch, args.seq)
    cmodel = compile_model(model, args)
    twell_compile.reset_stats()
    model.train()
    tokens_per_step = args.batch * args.seq
    loss_acc = torch.zeros((), device=args.device)
    n_acc, t_last, compile_s = 0, time.perf_counter(), None
    last_eval, last_ckpt = None, ckpt
    bar = None  # made after the first step, so that its rate and ETA are of compiled steps

    def make_bar(done: int):
        return tqdm(initial=done, total=args.steps, desc="sparse" if (args.l1 or args.target_density) else "dense",
                    disable=args.no_progress, dynamic_ncols=True)

    def dead_check(step: int) -> None:
        nonlocal fired
        dead = {k: ~v for k, v in fired.items()}
        n = sum(v.numel() for v in dead.values())
        before = {k: float(v.float().mean()) for k, v in dead.items()}
        rec = dict(step=step, window_steps=args.dead_check_every, probe_tokens=args.batch * args.seq,
                   dead_frac=sum(int(v.sum()) for v in dead.values()) / n, dead_frac_per_layer=before,
                   reinit=bool(args.reinit_dead))
        if args.reinit_dead:
            reinit_dead_rows(model, optimizer, dead, step, args.seed)
            # The same probe batches of the window again, now with the new rows: which still never fire?
            again = None
            for s in range(step - args.dead_check_every + args.dead_probe_every, step + 1, args.dead_probe_every):
                f = probe_fired(model, train_batch(data["train"], s, args.batch, args.seq, args.seed, 1)[:, :-1]
                                .to(args.device), args)
                again = f if again is None else {k: again[k] | f[k] for k in f}
            still = {k: dead[k] & ~again[k] for k in dead}
            rec["dead_frac_after"] = sum(int(v.sum()) for v in still.values()) / n
            rec["dead_frac_after_per_layer"] = {k: float(v.float().mean()) for k, v in still.items()}
        metrics.log("dead", **rec)
        fired = None

    step, time_up = start, False
    if start < args.steps and args.backend != "eager":
        print(f"compiling (first step; ~{COMPILE_S[args.preset]} s)...", file=sys.stderr, flush=True)
    for step in range(start, args.steps):
        lr = lr_at(step, args)
        for gi in optimizer.param_groups:
            gi["lr"] = lr
        w = train_batch(data["train"], step, args.batch, args.seq, args.seed).to(args.device, non_blocking=True)
        with autocast(args):
            logits = cmodel(input_ids=w[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten())
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_acc += loss.detach()
        n_acc += 1
        done = step + 1
        if compile_s is None:
            float(loss.detach())  # one sync: the first step's time is the compile time
            compile_s = time.perf_counter() - t_last
            metrics.log("compile", step=done, compile_s=compile_s)
            t_last, loss_acc, n_acc = time.perf_counter(), torch.zeros_like(loss_acc), 0
            bar = make_bar(done)
        else:
            bar.update(1)

        if args.dead_probe_every and done % args.dead_probe_every == 0:
            # Eager probe on a fresh batch of training text; activity accumulates on the device.
            f = probe_fired(model, train_batch(data["train"], done, args.batch, args.seq, args.seed, 1)[:, :-1]
                            .to(args.device), args)
            fired = f if fired is None else {k: fired[k] | f[k] for k in f}
            if args.dead_check_every and done % args.dead_check_every == 0:
                dead_check(done)

        if n_acc and (done % args.log_every == 0 or done == args.steps):
            train_loss = float(loss_acc) / n_acc  # the sync of this interval
            dt = time.perf_counter() - t_last
            st = twell_compile.layer_stats()
            mean_abs_h = sum(s.l1 for s in st.values()) / max(1, len(st))
            rec = dict(step=done, train_loss=train_loss, lr=lr, l1=args.l1, tokens_per_s=n_acc * tokens_per_step / dt,
                       elapsed_s=time.perf_counter() - t_start,
                       nnz_per_token={k: s.mean_nnz for k, s in st.items()},
                       max_nnz={k: s.max_nnz for k, s in st.items()},
                       density={k: s.density for k, s in st.items()},
                       mean_abs_h={k: s.l1 for k, s in st.items()}, l1_penalty=args.l1 * mean_abs_h,
                       hidden=args.ffn, dead_units={k: s.dead for k, s in st.items()})
            if args.target_density:        # the controller's coefficients (twell.l1's units) and target
                coef = {k: s.l1_coef for k, s in st.items()}
                rec.update(target_density=args.target_density, l1_coef=coef,
                           l1_penalty=sum((coef[k] or 0.0) * s.l1 for k, s in st.items()) / max(1, len(st)))
            metrics.log("train", **rec)
            mean_nnz = sum(rec["nnz_per_token"].values()) / max(1, len(st))
            bar.set_postfix(loss=f"{train_loss:.3f}", nnz=f"{mean_nnz:.1f}/{args.ffn}",
                            val=f"{last_eval:.3f}" if last_eval is not None else "-", refresh=False)
            loss_acc.zero_()
            n_acc, t_last = 0, time.perf_counter()

        if done % args.eval_every == 0 or done == args.steps:
            t0 = time.perf_counter()
            last_eval = evaluate(model, vals, args)
            metrics.log("eval", step=done, val_loss=last_eval, val_tokens=len(vals) * args.batch * args.seq,
                        eval_s=time.perf_counter() - t0)
            t_last += time.perf_counter() - t0  # evaluation time is not training throughput

        if (args.ckpt_every and done % args.ckpt_every == 0) or done == args.steps:
            t0 = time.perf_counter()
            extra = {f"fired:{k}": v.to(torch.uint8) for k, v in (fired or {}).items()}
            last_ckpt = save_checkpoint(out, done, model, optimizer, extra, dict(args=cfg_rec), args.keep_ckpts)
            t_last += time.perf_counter() - t0
        if args.stop_after and done - start >= args.stop_after:
            break
        if args.time_limit_min and time.perf_counter() - t_start > 60 * args.time_limit_min and done < args.steps:
            time_up = True  # finish like a completed run (final eval, probe, checkpoint) at this step
            last_eval = evaluate(model, vals, args)
            metrics.log("eval", step=done, val_loss=last_eval, val_tokens=len(vals) * args.batch * args.seq)
            extra = {f"fired:{k}": v.to(torch.uint8) for k, v in (fired or {}).items()}
            last_ckpt = save_checkpoint(out, done, model, optimizer, extra, dict(args=cfg_rec), args.keep_ckpts)
            metrics.log("time_limit", step=done, time_limit_min=args.time_limit_min)
            break
    if bar is not None:
        bar.close()

    summary: dict[str, Any] = dict(out=str(out), steps=args.steps, last_step=step + 1 if args.steps > start else start)
    finished = summary["last_step"] >= args.steps or time_up
    if finished:
        # Final probe on validation text: the per-token / per-position non-zero distribution.
        probe = val_batches(data["val"], 1, args.final_probe_batch, args.seq)[0][:, :-1].to(args.device)
        counts = probe_counts(model, probe, args)
        nnz = nnz_summary(counts, args.ffn)
        fired_all = probe_fired(model, probe, args)
        final = dict(step=summary["last_step"], stopped_by_time_limit=time_up, val_loss=last_eval, nnz=nnz,
                     dead_frac_final_probe=sum(int((~v).sum()) for v in fired_all.values())
                     / sum(v.numel() for v in fired_all.values()),
                     mean_nnz_per_token=sum(v["mean"] for v in nnz.values()) / len(nnz),
                     mean_density=sum(v["density"] for v in nnz.values()) / len(nnz),
                     wall_s=time.perf_counter() - t_start)
        metrics.log("final", **final)
        summary.update(final)
        if args.profile_out:
            profile = dict(source="examples/train_sparse_lm.py", corpus="python stdlib " + data["root"],
                           model=dict(d_model=args.d_model, ffn=args.ffn, layers=args.layers, gated=True),
                           l1=args.l1, steps=summary["last_step"], probe_tokens=int(probe.numel()),
                           layers={k: {f: v[f] for f in ("hidden", "tokens", "mean", "density", "quantiles",
                                                         "hist_values", "hist_counts")} for k, v in nnz.items()})
            Path(args.profile_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.profile_out).write_text(json.dumps(profile, indent=1))
        if args.bench_forward:
            try:
                bench = bench_forward(model, vals, args)
            except Exception as e:  # a failing kernel must not lose the finished training run
                bench = dict(error=f"{type(e).__name__}: {e}"[:2000])
                print(f"bench-forward failed: {bench['error']}", file=sys.stderr)
            metrics.log("bench", step=summary["last_step"], **bench)
            summary["bench"] = bench
    metrics.close()
    plots, no_plots = [], "--no-plots" if args.no_plots else "the run is not finished"
    if not args.no_plots and finished:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            no_plots = "matplotlib not installed: pip install -e '.[examples]'"
            print(f"no plots: {no_plots}", file=sys.stderr)
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import plot_training

            plots = plot_training.make_plots(out, Path(args.dense_run) if args.dense_run else None, out / "plots")
    summary["outputs"] = outputs_of(out, last_ckpt, args, plots, no_plots,
                                    profile=args.profile_out if finished and args.profile_out else "")
    return summary


def outputs_of(out: Path, ckpt: Optional[Path], args, plots: Optional[list[Path]] = None,
               no_plots: str = "none made", profile: Optional[str] = None) -> dict[str, Any]:
    """What a run wrote, by kind, for the closing lines. plots=None / profile=None: those an
    earlier run left (out/plots/*.png, --profile-out if it exists)."""
    if plots is None:
        plots = sorted((out / "plots").glob("*.png"))
    if profile is None:
        profile = args.profile_out if args.profile_out and Path(args.profile_out).exists() else ""
    script = Path(__file__).resolve().with_name("plot_training.py")
    try:
        script = script.relative_to(Path.cwd())
    except ValueError:
        pass
    return dict(checkpoint=str(ckpt) if ckpt else None, metrics=str(out / "metrics.jsonl"),
                plots=[str(p) for p in plots], no_plots=no_plots, profile=profile or None,
                plot_command=f"python {script} {out}" + (f" {args.dense_run}" if args.dense_run else "")
                + f" --out {out / 'plots'}")


def closing_lines(s: dict[str, Any], args) -> list[str]:
    """What main prints at the end: the result, where every output went, how to plot again."""
    if s.get("complete"):
        lines = [f"run complete: {s['out']} is at step {s['last_step']} of --steps {s['steps']}, nothing to "
                 f"resume (a new run needs another --out, or no --resume)"]
    elif "val_loss" in s:
        lines = [f"final: val loss {s['val_loss']:.4f}, mean non-zeros per token {s['mean_nnz_per_token']:.1f} of "
                 f"{args.ffn} ({100 * s['mean_density']:.2f}%), dead {100 * s['dead_frac_final_probe']:.1f}%, "
                 f"{s['wall_s']:.0f} s"]
    else:
        lines = [f"stopped at step {s['last_step']} of {s['steps']}: continue with --resume auto"]
    o = s["outputs"]
    plots = o["plots"]
    lines += [f"  checkpoint  {o['checkpoint'] or 'none yet (one is written every --ckpt-every steps)'}",
              f"  metrics     {o['metrics']}",
              "  plots       " + (f"{Path(plots[0]).parent}/ ({', '.join(Path(p).name for p in plots)})" if plots
                                  else f"none ({o['no_plots']})"),
              f"  profile     {o['profile'] or 'none (--profile-out FILE writes it)'}",
              f"  make plots: {o['plot_command']}"]
    return lines


@torch.no_grad()
def bench_forward(model, vals: list[torch.Tensor], args) -> dict[str, Any]:
    """Inference forward of the trained model on its real activations: Inductor vs twell.
    Exactness (max |logits difference| against eager) and median time per forward."""
    model.eval()
    x = torch.cat(vals)[: args.bench_batch, :-1].to(args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    with autocast(args):
        ref = model(input_ids=x).logits.float()
    res: dict[str, Any] = dict(batch=list(x.shape), dtype="bf16" if args.device.startswith("cuda") and args.bf16 else "fp32")
    for backend in ("inductor", "twell"):
        torch._dynamo.reset()
        f = torch.compile(model, backend=backend)
        with autocast(args):
            got = f(input_ids=x).logits.float()
            for _ in range(3):
                f(input_ids=x)
            times = []
            for _ in range(args.bench_iters):
                sync()
                t0 = time.perf_counter()
                f(input_ids=x)
                sync()
                times.append(time.perf_counter() - t0)
        times.sort()
        res[backend] = dict(median_ms=1e3 * times[len(times) // 2], max_abs_diff_vs_eager=float((got - ref).abs().max()))
    res["speedup_twell_vs_inductor"] = res["inductor"]["median_ms"] / res["twell"]["median_ms"]
    model.train()
    return res


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-tiny")
    ap.add_argument("--out", required=True, help="run directory (metrics.jsonl, ckpt/, plots/)")
    ap.add_argument("--cache-dir", help="tokenizer / token cache (default: <out>/../cache)")
    ap.add_argument("--corpus-dir", help="directory of *.py files (default: the stdlib of this Python)")
    ap.add_argument("--baseline", action="store_true", help="dense-ReLU baseline: same run with --l1 0")
    ap.add_argument("--target-density", type=float, default=0.0,
                    help="twell.target_density: adapt each layer's L1 coefficient to hold this fraction of "
                         "hidden units active per token (replaces --l1)")
    ap.add_argument("--target-steps", type=int, default=0,
                    help="twell.target_steps: move the target from the first measured density over this many steps")
    ap.add_argument("--backend", choices=["twell", "inductor", "eager"], default="twell")
    ap.add_argument("--resume", default="", help="checkpoint dir, or 'auto' for <out>/ckpt/latest")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--val-pct", type=int, default=10, help="percent of files held out for validation")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="fp32 on CUDA (default: bf16 autocast)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--reinit-dead", action="store_true",
                    help="re-initialise gate rows that never fired over a --dead-check-every window")
    ap.add_argument("--keep-ckpts", type=int, default=2)
    ap.add_argument("--stop-after", type=int, default=0, help="stop after this many steps (to test resuming)")
    ap.add_argument("--time-limit-min", type=float, default=0.0,
                    help="stop training after this many minutes (then the usual final eval, probe, checkpoint)")
    ap.add_argument("--final-probe-batch", type=int, default=0, help="sequences in the final probe (default: batch)")
    ap.add_argument("--profile-out", help="write the per-layer non-zeros-per-token distribution here (JSON)")
    ap.add_argument("--bench-forward", action="store_true", help="after training: inductor vs twell inference forward")
    ap.add_argument("--bench-batch", type=int, default=8)
    ap.add_argument("--bench-iters", type=int, default=20)
    ap.add_argument("--dense-run", help="a dense run's directory: adds the dense-vs-sparse validation plot")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    types = {k: type(v) for k, v in PRESETS["cpu-tiny"].items()}
    for k, t in types.items():
        ap.add_argument("--" + k.replace("_", "-"), type=t, default=None, help="(preset value unless given)")
    args = ap.parse_args(argv)
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.baseline:
        args.l1 = 0.0
        if args.target_density:
            raise SystemExit("--baseline trains without a penalty: leave --target-density out")
    if args.target_density:
        args.l1 = 0.0          # the controller's coefficient replaces the preset's fixed one
    elif args.target_steps:
        raise SystemExit("--target-steps needs --target-density")
    if args.cache_dir is None:
        args.cache_dir = str(Path(args.out).resolve().parent / "cache")
    if not args.final_probe_batch:
        args.final_probe_batch = args.batch
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device; use --preset cpu-tiny or --device cpu")
    if args.dead_check_every and args.dead_probe_every and args.dead_check_every % args.dead_probe_every:
        raise SystemExit("--dead-check-every must be a multiple of --dead-probe-every")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    s = train(args)
    print("\n".join(closing_lines(s, args)))


if __name__ == "__main__":
    main()
