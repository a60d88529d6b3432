"""End to end: a Hugging Face LlamaForCausalLM with sparse ReLU FFNs, Inductor vs twell, one run.

    python3 benchmarks/bench_e2e.py --density 0.005 0.02 --out runs/e2e_forward.json   # whole-model forward
    python3 benchmarks/bench_e2e.py --generate --seq 128 --new-tokens 128                # generate()
    python3 benchmarks/bench_e2e.py --train --layers 4 --batch 2 --seq 1024              # training step
    python3 benchmarks/bench_e2e.py --tiny --train                                       # CPU-sized

Model: hidden 2048, intermediate 5632, 16 layers, 16 heads, vocab 32000, ``hidden_act="relu"``,
``mlp_bias=True``, random weights (HF init; up/down biases drawn N(0, 0.02)). Each layer's
``gate_proj.bias`` is calibrated, layer by layer in order, on a calibration batch distinct from
the timed one (--calib-batch sequences, 256 by default: tokens of one sequence share context, and
8 sequences gave 10x the target density on the timed batch at 16 layers, H200, 2026-11-22):
bias[j] = -(the (1-d) quantile of neuron j's pre-activation over the calibration tokens), so
each neuron fires on about d of the tokens. The achieved density per layer is
measured on the timed batch (eager, hooks on gate_proj) and printed; twell's own
``layer_stats()`` after its timed calls is reported beside it.

--forward (default): bf16 weights, ``model(input_ids)`` at batch x seq tokens; eager, Inductor
  and twell on deep copies of one model (same weights, same inputs). Per backend: median ms
  (CUDA events, warm-up calls first), tokens/s, max |logit - eager|, peak memory, energy per
  token from NVML's total-energy counter (null with the reason where unavailable).
  ``--rounds R``: the backends' timed calls in R interleaved rounds instead of one backend's
  reps after the other's, each round's order rotated; each backend's calls pooled, and the run
  carries each round's medians (``rounds_ms``) and twell / Inductor per round
  (``speedup_twell_over_inductor_by_round``). Where the model is near host-bound (1 x 2048
  tokens in the default mode), the host's speed drifts within a run
  (benchmarks/probes/host_cpus.py), and timed one after the other the backends see different
  hosts (results/h200/e2e_prefill_2048_default.json); no energy is read then.
--generate: bf16, HF ``generate()`` with ``cache_implementation="static"`` and greedy
  decoding; the decode step is compiled the way transformers does it for a static cache
  (``compile_config=CompileConfig(backend=..., mode="reduce-overhead")``: prefill runs eager,
  decode steps compiled and CUDA-graphed). Decode tokens/s exclude prefill: a logits processor
  records an event at every step, and the time from the first to the last step counts
  batch x (new_tokens - 1) tokens. Greedy tokens are compared with eager generate.
  --seq is the prompt length here.
--train: fp32 weights, bf16 autocast (fp32 without autocast on CPU), AdamW, ``--steps`` steps
  (labels = inputs): eager, Inductor and twell each start from the same weights, see the same
  batches, are run one after the other (only one model alive), and report median step ms,
  peak memory and the loss curve. ``--data fixed`` (default) repeats one random-token batch,
  which the model memorises (the loss falls toward 0); ``--data text`` draws a fresh batch every
  step from the bytes of the Python standard library's sources (offline on every machine, as
  examples/train_sparse_lm.py's corpus), so the model keeps learning as in a real training:
  what a density controller (``twell.target_density``) should be judged on. ``--lr-warmup N``
  ramps the learning rate linearly over the first N steps (without it, on text, the first AdamW
  step at 3e-4 lifted an H200 run's loss from 10.8 to 16 and every layer's density 15-30x).
  twell's row carries every step's per-layer density (``twell_layer_density_per_step``) and
  each layer's spread over the second half (``twell_layer_density_log_sd``), with a fixed
  ``twell.l1`` too: there the spread is the batches' own, the floor a controller works above.

Backend options: ``--twell-opt twell.stats=false`` (repeatable) goes to
``torch.compile(..., backend="twell", options={...})``. Results go to --out as JSON (default
runs/<gpu>/e2e_<mode>.json; the canonical files: benchmarks/results/README.md): one row per
density (benchmarks/rows.py's schema), each with the mode, ``config`` (every flag) and ``env``
(device, versions, the run's start time) beside its figures.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import functools
import gc
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

if __package__ in (None, ""):                  # run as a file: python3 benchmarks/bench_e2e.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.rows import out_path, stamp, write_json  # noqa: E402
from benchmarks.timing import gpu_name, policy_changes  # noqa: E402

FULL = dict(layers=16, hidden=2048, ffn=5632, heads=16, kv_heads=16, vocab=32000, batch=8, seq=2048,
            density=[0.005], steps=20, new_tokens=128, warmup=3, reps=10, calib_batch=256)
# CPU-sized: small enough that every mode (three compiles each) runs in seconds on 2 cores.
TINY = dict(layers=2, hidden=64, ffn=176, heads=4, kv_heads=2, vocab=128, batch=2, seq=64,
            density=[0.1], steps=4, new_tokens=6, warmup=1, reps=2, calib_batch=64)
BIAS_STD = 0.02
MIN_ENERGY_S = 2.0  # NVML's energy counter updates every ~20-100 ms: time at least this long


# ----------------------------------------------------------------------------- arguments

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--forward", dest="mode", action="store_const", const="forward")
    mode.add_argument("--generate", dest="mode", action="store_const", const="generate")
    mode.add_argument("--train", dest="mode", action="store_const", const="train")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized config (tests); other flags override it")
    for name in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "batch", "seq", "steps", "new_tokens",
                 "warmup", "reps"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                        help=f"default {FULL[name]} ({TINY[name]} with --tiny)")
    ap.add_argument("--density", type=float, nargs="+", default=None,
                    help=f"target FFN densities, one run each (default {FULL['density']})")
    ap.add_argument("--calib-batch", type=int, default=None,
                    help=f"calibration sequences of --seq tokens, run --batch at a time "
                         f"(default {FULL['calib_batch']}, {TINY['calib_batch']} with --tiny): see calibrate()")
    ap.add_argument("--device", default=None, help="default cuda when available, else cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                    help="forward/generate weights (default bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--lr", type=float, default=3e-4, help="--train: AdamW learning rate")
    ap.add_argument("--lr-warmup", type=int, default=0,
                    help="--train: linear learning-rate warm-up over this many optimizer steps (default 0: none)")
    ap.add_argument("--data", choices=("fixed", "text"), default="fixed",
                    help="--train: one random batch repeated (default), or a fresh batch of stdlib source bytes "
                         "per step (calibration from the same text)")
    ap.add_argument("--pure-bf16", action="store_true",
                    help="--train: bf16 weights and AdamW state, no autocast (default fp32 weights, bf16 autocast)")
    ap.add_argument("--backends", nargs="+", default=["inductor", "twell"], choices=("inductor", "twell"))
    ap.add_argument("--twell-opt", action="append", default=[], metavar="KEY=VALUE",
                    help="twell option, e.g. twell.stats=false (repeatable)")
    ap.add_argument("--policy", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="run with these fields of the GPU record replaced (arch.patched), e.g. compact_max_lost=-1")
    ap.add_argument("--no-energy", action="store_true")
    ap.add_argument("--step-loop", action="store_true",
                    help="--generate: also time a greedy loop of the compiled model's one-token forward "
                         "(static cache, no generate() host work between steps; compiled backends only)")
    ap.add_argument("--compile-mode", choices=("reduce-overhead", "default"), default="reduce-overhead",
                    help="--generate: torch.compile mode of the decode step (default: no CUDA graphs, "
                         "each op call issued from the host)")
    ap.add_argument("--down-layout", choices=("linear", "transposed"), default="linear",
                    help="--forward: the twell model's down weights as nn.Linear stores them, or re-stored in "
                         "[N, K_out] rows by twell_compile.prepare(down_layout='transposed') before compiling "
                         "(the Inductor and eager models keep nn.Linear's storage)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="--forward: time the backends in this many interleaved rounds of reps/rounds calls each "
                         "(the order rotated per round; rows: each backend's calls pooled, and the per-round "
                         "ratio), so a drift of the host's speed during the run reaches every backend alike; "
                         "1 (default): each backend's reps one after the other")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here (default runs/<gpu>/e2e_<mode>.json)")
    a = ap.parse_args(argv)
    a.mode = a.mode or "forward"
    preset = TINY if a.tiny else FULL
    for key, value in preset.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.kv_heads = a.kv_heads if a.kv_heads <= a.heads else a.heads
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.dtype is None:
        a.dtype = "bfloat16" if a.device.startswith("cuda") else "float32"
    for name in ("layers", "hidden", "ffn", "heads", "vocab", "batch", "seq", "steps", "reps", "calib_batch"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    policy_changes(a.policy)                     # a bad FIELD=VALUE fails here, before any work
    if a.hidden % a.heads or a.heads % a.kv_heads:
        raise ValueError(f"--hidden ({a.hidden}) must divide by --heads ({a.heads}), --heads by --kv-heads")
    if a.new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 (decode time runs from the first to the last), got {a.new_tokens}")
    if a.step_loop and a.new_tokens <= STEP_LOOP_WARM + 1:
        raise ValueError(f"--step-loop leaves {STEP_LOOP_WARM} steps untimed: --new-tokens must be > "
                         f"{STEP_LOOP_WARM + 1}, got {a.new_tokens}")
    if a.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {a.warmup}")
    if a.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {a.rounds}")
    if a.rounds > 1 and a.mode != "forward":
        raise ValueError(f"--rounds interleaves the --forward timings only; --{a.mode} times its backends one "
                         f"after the other (leave --rounds at 1)")
    if a.lr_warmup < 0:
        raise ValueError(f"--lr-warmup must be >= 0, got {a.lr_warmup}")
    for d in a.density:
        if not 0.0 < d <= 1.0:
            raise ValueError(f"--density must be in (0, 1], got {d}")
    a.twell_options = parse_twell_options(a.twell_opt)
    return a


def parse_twell_options(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.startswith("twell."):
            raise ValueError(f"--twell-opt wants twell.NAME=VALUE, got {item!r}")
        low = raw.lower()
        if low in ("true", "false"):
            out[key] = low == "true"
        else:
            try:
                out[key] = int(raw)
            except ValueError:
                try:
                    out[key] = float(raw)
                except ValueError:
                    out[key] = raw
    return out


# ----------------------------------------------------------------------------- model

def build_model(a: argparse.Namespace, dtype: torch.dtype, seed: int):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, hidden_act="relu", mlp_bias=True,
        max_position_embeddings=max(4096, a.seq + a.new_tokens + 8), pad_token_id=0, bos_token_id=1,
        eos_token_id=None, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(a.device):
        model = transformers.LlamaForCausalLM(cfg)
        with torch.no_grad():
            for layer in model.model.layers:  # HF zero-inits biases: random ones exercise the bias path
                layer.mlp.up_proj.bias.normal_(0.0, BIAS_STD)
                layer.mlp.down_proj.bias.normal_(0.0, BIAS_STD)
    return model.to(dtype)


def token_batch(a: argparse.Namespace, batch: int, seq: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, a.vocab, (batch, seq), generator=g).to(a.device)


TEXT_BYTES = 64 << 20   # --data text reads this much of the standard library's sources at most


@functools.lru_cache(maxsize=1)
def stdlib_bytes(limit: int = TEXT_BYTES) -> torch.Tensor:
    """The bytes of the interpreter's own *.py sources (site-packages and caches left out),
    files in path order, up to ``limit``: uint8 on the CPU, read once per process (calibration
    and training both draw from it; callers only index it)."""
    import sysconfig

    root, parts, n = Path(sysconfig.get_paths()["stdlib"]), [], 0
    for p in sorted(root.rglob("*.py")):
        if {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts):
            continue
        data = p.read_bytes()
        parts.append(data)
        n += len(data)
        if n >= limit:
            break
    if not parts:
        raise SystemExit(f"--data text: no *.py sources under {root}")
    return torch.frombuffer(bytearray(b"".join(parts)[:limit]), dtype=torch.uint8)


def text_batches(a: argparse.Namespace, count: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """[count, batch, seq] token ids on a.device: windows of the stdlib's bytes at seeded random
    offsets, each byte b as token 2 + b % (vocab - 2) (ids 0 and 1 unused, as token_batch)."""
    text = stdlib_bytes()
    if text.numel() <= seq:
        raise SystemExit(f"--data text: {text.numel()} bytes of sources, fewer than --seq {seq}")
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, text.numel() - seq, (count * batch, 1), generator=g)
    ids = text[start + torch.arange(seq)].long() % (a.vocab - 2) + 2
    return ids.view(count, batch, seq).to(a.device)


class _Captured(Exception):
    """Raised by a pre-hook to stop a forward once the wanted input is captured."""

    def __init__(self, args: tuple, kwargs: dict):
        super().__init__()
        self.args, self.kwargs = args, kwargs


def _capture_input(module, run: Callable[[], Any]) -> tuple[tuple, dict]:
    """(args, kwargs) of `module`'s next call inside run(); the rest of the forward is skipped."""
    def hook(_module, args, kwargs):
        raise _Captured(args, kwargs)

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        run()
    except _Captured as c:
        return c.args, c.kwargs
    finally:
        handle.remove()
    raise RuntimeError(f"{type(module).__name__} was not called")


def _layer_out(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # decoder layers return a tensor in HF 5, a tuple in 4.x


@torch.no_grad()
def calibrate(model, ids: torch.Tensor, density: float, amp, chunk: int) -> list[float]:
    """Set every gate bias so that each neuron fires on round(d * T) of the T calibration tokens.

    Layer by layer (layer i's input depends on layers < i being calibrated first): the inputs
    of layer i for all calibration sequences are kept (`chunk` sequences per forward), the
    per-neuron (1-d) quantile of gate(x) over them sets the bias, then layer i runs with its new
    bias to give layer i+1's inputs. Tokens of one sequence share context, so the quantile needs
    many sequences to hold on other batches (a random-weight model measured on the CPU, 4 layers,
    d=0.005, deepest layer: 4 calibration sequences of 512 tokens gave 0.051 on a fresh batch, 64 gave
    0.0071, 256 gave 0.0049).
    Returns each layer's density on the calibration tokens."""
    layers = model.model.layers
    t = ids.numel()
    fire = int(round(density * t))
    states = []
    for i in range(0, ids.shape[0], chunk):
        part = ids[i:i + chunk]

        def run():
            with amp():
                model.model(input_ids=part, use_cache=False)

        args, kwargs = _capture_input(layers[0], run)
        states.append((args[0], kwargs))
    achieved = []
    for layer in layers:
        gate = layer.mlp.gate_proj
        top = low = None
        for h, kw in states:
            def run():
                with amp():
                    layer(h, **kw)

            (x,), _ = _capture_input(layer.mlp, run)
            with amp():
                pre = F.linear(x, gate.weight).reshape(-1, gate.out_features).float()
            k = min(fire + 1, pre.shape[0])
            cand = pre.topk(k, dim=0).values
            top = cand if top is None else torch.cat([top, cand]).topk(min(fire + 1, top.shape[0] + k), dim=0).values
            low = pre.amin(0) if low is None else torch.minimum(low, pre.amin(0))
        # the (fire+1)-th largest value: exactly `fire` tokens lie above it (ties aside)
        thresh = low - 1.0 if fire >= t else top[fire]
        gate.bias.copy_(-thresh)
        fired = 0.0
        nxt = []
        for h, kw in states:
            counts = []
            hook = gate.register_forward_hook(lambda _m, _i, out: counts.append((out > 0).sum()))
            try:
                with amp():
                    nxt.append((_layer_out(layer(h, **kw)), kw))
            finally:
                hook.remove()
            fired += float(counts[0])
        states = nxt
        achieved.append(fired / (t * gate.out_features))
    return achieved


@torch.no_grad()
def measure_density(model, ids: torch.Tensor, amp) -> list[float]:
    """Fraction of relu(gate(x)) > 0 per layer on `ids` (eager forward with hooks)."""
    counts: list[torch.Tensor] = []
    hooks = [layer.mlp.gate_proj.register_forward_hook(lambda _m, _i, out: counts.append((out > 0).float().mean()))
             for layer in model.model.layers]
    try:
        with amp():
            model.model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [float(c) for c in counts]


def copy_params(dst, src) -> None:
    """Copy weights in place: compiled graphs read parameters as inputs, so no recompile."""
    with torch.no_grad():
        for (n1, p1), (n2, p2) in zip(dst.named_parameters(), src.named_parameters()):
            assert n1 == n2
            p1.copy_(p2)


def twell_stats_density() -> dict[str, float]:
    import twell_compile

    return {name: s.density for name, s in twell_compile.layer_stats().items()}


def twell_layer_densities() -> dict[str, torch.Tensor]:
    """Each layer's density in its latest call, on the device (no host sync)."""
    from twell_compile import stats

    return stats.densities()


def twell_dead_units() -> dict[str, Optional[int]]:
    """Each layer's hidden units that fired on none of its last training tokens
    (``layer_stats()``'s ``dead``: stats.DEAD_WINDOW tokens), with a fixed penalty or none too."""
    import twell_compile

    return {k: s.dead for k, s in twell_compile.layer_stats().items()}


def density_fields(history: list[dict[str, torch.Tensor]], target: Any) -> dict[str, Any]:
    """A twell training's per-step per-layer densities, its final coefficients, each layer's
    spread (``twell_layer_density_log_sd``: the standard deviation of log density over the
    second half of the steps: with a fixed coefficient, how far the batches alone move a
    layer's density step to step; with a target, what the controller leaves), and (one target
    for every layer) the worst relative deviation of any layer's density from the target from
    step 20 on."""
    import twell_compile

    per_step = {k: [float(h[k]) for h in history if k in h] for k in (history[-1] if history else {})}
    st = twell_compile.layer_stats()
    out = dict(twell_layer_density_per_step=per_step, twell_layer_l1_coef={k: s.l1_coef for k, s in st.items()},
               twell_layer_density_log_sd=layer_spreads(per_step))
    after = [d for v in per_step.values() for d in v[20:]]
    if isinstance(target, float) and after:
        out["twell_worst_rel_dev_from_step_20"] = max(abs(d / target - 1) for d in after)
    return out


def layer_spreads(per_step: dict[str, list[float]]) -> dict[str, Optional[float]]:
    """Each layer's ``twell_layer_density_log_sd``: the population standard deviation of log
    density over the positive densities of the second half of its steps (None under two)."""
    out = {}
    for layer, dens in per_step.items():
        logs = [math.log(v) for v in dens[len(dens) // 2:] if v > 0]
        out[layer] = statistics.pstdev(logs) if len(logs) >= 2 else None
    return out


def twell_sparse_layers(densities: dict[str, float], hidden: int, ffn: int, tokens: Optional[int] = None
                        ) -> Optional[int]:
    """Layers whose measured density the GPU record's density rule sends to the TwELL kernels
    (bf16 weights; select.twell_wins, for ``tokens`` per FFN call where given: its margin under
    min_tokens)."""
    if not torch.cuda.is_available():
        return None
    from twell_compile.runtime import arch, select

    p = arch.policy_for(torch.device("cuda"))
    return sum(select.twell_wins(p, d, True, hidden, ffn, hidden, 2, tokens) for d in densities.values())


def calibrated_model(a: argparse.Namespace, amp, density: Optional[float] = None) -> tuple[torch.nn.Module, list[float]]:
    """The fp32 model of seed a.seed (eval mode) with its gate biases calibrated to ``density``
    (default a.density[0]) on the calibration batch, and the densities reached."""
    model = build_model(a, torch.float32, a.seed).eval()
    d = a.density[0] if density is None else density
    calib = (text_batches(a, 1, a.calib_batch, a.seq, a.seed + 1)[0] if a.data == "text"
             else token_batch(a, a.calib_batch, a.seq, a.seed + 1))
    return model, calibrate(model, calib, d, amp, a.batch)


def cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's state dict on the CPU (training_setup's input)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def training_setup(a: argparse.Namespace, state: dict[str, torch.Tensor], backend: str,
                   dtype: torch.dtype = torch.float32):
    """(model, AdamW, the callable to train): a fresh model with ``state`` loaded, in train mode;
    the callable is the model itself for "eager", else the model compiled for ``backend``."""
    model = build_model(a, dtype, a.seed + 100)
    model.load_state_dict(state)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    fwd = model if backend == "eager" else torch.compile(model, **compile_kwargs(backend, a, None))
    if backend == "twell":
        reset_twell_policy()
    return model, opt, fwd


def reset_twell_policy() -> None:
    """Fresh density measurements (runtime/density.py), as a new process would have: a dense
    layer re-probes only every probe_every calls (64 on the H200 record), so a density change
    between runs would otherwise be seen late. (Statistics buffers are kept: they are reserved
    at compile time, outside any CUDA-graph pool.)"""
    from twell_compile.runtime import density

    density.reset()


# ----------------------------------------------------------------------------- measuring

class Energy:
    """NVML's total energy counter (mJ since driver load), through pynvml or ctypes."""

    def __init__(self, device: torch.device):
        self.reason: Optional[str] = None
        self._read: Optional[Callable[[], int]] = None
        if device.type != "cuda":
            self.reason = f"device {device} has no NVML energy counter"
            return
        props = torch.cuda.get_device_properties(device)
        if not hasattr(props, "pci_bus_id"):
            self.reason = f"torch {torch.__version__} does not give the GPU's PCI bus id to find it in NVML"
            return
        # NVML numbers GPUs ignoring CUDA_VISIBLE_DEVICES: find ours by its PCI bus id.
        bus = f"{getattr(props, 'pci_domain_id', 0):08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
        try:
            import pynvml
        except ImportError:
            pynvml = None
        if pynvml is not None:
            try:
                pynvml.nvmlInit()
                handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus.encode())  # bytes: every version takes them
                pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
                self._read = lambda: int(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
            except pynvml.NVMLError as e:
                self.reason = f"pynvml: {e}"
            return
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as e:
            self.reason = f"libnvidia-ml.so.1 not loadable: {e}"
            return
        lib.nvmlErrorString.restype = ctypes.c_char_p

        def check(rc: int, what: str) -> bool:
            if rc != 0:
                self.reason = f"{what}: {lib.nvmlErrorString(rc).decode()} (NVML {rc})"
            return rc == 0

        handle = ctypes.c_void_p()
        mj = ctypes.c_ulonglong()
        if not (check(lib.nvmlInit_v2(), "nvmlInit_v2")
                and check(lib.nvmlDeviceGetHandleByPciBusId_v2(bus.encode(), ctypes.byref(handle)),
                          f"nvmlDeviceGetHandleByPciBusId_v2({bus})")
                and check(lib.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(mj)),
                          "nvmlDeviceGetTotalEnergyConsumption")):
            return

        def read() -> int:
            rc = lib.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(mj))
            if rc != 0:
                raise RuntimeError(f"nvmlDeviceGetTotalEnergyConsumption failed: NVML {rc}")
            return int(mj.value)

        self._read = read

    def read_mj(self) -> Optional[int]:
        return self._read() if self._read is not None else None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int,
               energy: Optional[Energy]) -> dict[str, Any]:
    """Median ms over timed calls (CUDA events on CUDA); the energy over the timed calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    est = time.perf_counter() - t0
    if energy is not None and energy.read_mj() is not None:
        reps = max(reps, min(500, math.ceil(MIN_ENERGY_S / max(est, 1e-6))))
    e0 = energy.read_mj() if energy is not None else None
    w0 = time.perf_counter()
    ms = each_call_ms(fn, device, reps)
    wall = time.perf_counter() - w0
    e1 = energy.read_mj() if energy is not None else None
    return dict(median_ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms), reps=reps, wall_s=wall,
                energy_j=None if e0 is None or e1 is None else (e1 - e0) / 1e3)


def each_call_ms(fn: Callable[[], Any], device: torch.device, reps: int) -> list[float]:
    """ms of each of ``reps`` back-to-back calls: CUDA events around each on CUDA (one sync at
    the end), else the wall clock."""
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        sync(device)
        return [s.elapsed_time(e) for s, e in events]
    ms = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t) * 1e3)
    return ms


def interleaved_calls(fns: dict[str, Callable[[], Any]], device: torch.device, reps: int,
                      rounds: int) -> tuple[dict[str, dict[str, Any]], list[dict[str, float]]]:
    """Each backend's calls timed in ``rounds`` rounds of ceil(reps / rounds) back-to-back calls
    (CUDA events on CUDA, else the wall clock), every round visiting every backend, the order
    rotated by one per round. Returns (per backend: median_ms, min_ms, max_ms, reps over its
    pooled calls; per round: each backend's median ms). Warm the backends up first."""
    names = list(fns)
    per = max(1, -(-reps // rounds))
    pooled: dict[str, list[float]] = {name: [] for name in names}
    by_round: list[dict[str, float]] = []
    for r in range(rounds):
        got = {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            sync(device)
            ms = each_call_ms(fns[name], device, per)
            pooled[name] += ms
            got[name] = statistics.median(ms)
        by_round.append({name: got[name] for name in names})
    timing = {name: dict(median_ms=statistics.median(v), min_ms=min(v), max_ms=max(v), reps=len(v))
              for name, v in pooled.items()}
    return timing, by_round


def energy_fields(timing: dict[str, Any], tokens: int, energy: Optional[Energy], reason_off: str) -> dict[str, Any]:
    if timing["energy_j"] is not None:
        return dict(energy_j_per_token=timing["energy_j"] / tokens, energy_reason=None)
    reason = reason_off if energy is None else (energy.reason or "counter did not advance")
    return dict(energy_j_per_token=None, energy_reason=reason)


def peak_memory(device: torch.device) -> Optional[int]:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


@torch.no_grad()
def logit_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """max |a - b| and ||a - b|| / ||b||, in fp32, row chunks (logits reach GBs)."""
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    mx, num, den = 0.0, 0.0, 0.0
    for i in range(0, a2.shape[0], 1024):
        x, y = a2[i:i + 1024].float(), b2[i:i + 1024].float()
        d = x - y
        if torch.isnan(d).any():
            return float("nan"), float("nan")
        mx = max(mx, float(d.abs().max()))
        num += float(d.double().pow(2).sum())
        den += float(y.double().pow(2).sum())
    return mx, math.sqrt(num) / max(math.sqrt(den), 1e-30)


def compile_kwargs(backend: str, a: argparse.Namespace, mode: Optional[str]) -> dict[str, Any]:
    """torch.compile refuses mode= with options=: twell carries the mode as twell.mode."""
    if backend == "twell" and a.twell_options:
        opts = dict(a.twell_options)
        if mode:
            opts["twell.mode"] = mode
        # mode=None said explicitly: HF's CompileConfig defaults to reduce-overhead, and
        # torch.compile refuses a mode next to options
        return dict(backend="twell", options=opts, mode=None)
    return dict(backend=backend, mode=mode)


def env_info(a: argparse.Namespace) -> dict[str, Any]:
    import transformers
    import triton

    dev = torch.device(a.device)
    return dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", torch=torch.__version__,
                transformers=transformers.__version__, triton=triton.__version__, python=sys.version.split()[0],
                time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def write(out: Optional[str], rows: list[dict[str, Any]]) -> None:
    if out:
        write_json(out, rows)


def print_density(d: float, calib: list[float], timed: list[float]) -> None:
    print(f"density target {d}: calibration batch mean {statistics.mean(calib):.5f}; timed batch per layer: "
          + " ".join(f"{v:.4f}" for v in timed) + f" (mean {statistics.mean(timed):.5f})", flush=True)


# ----------------------------------------------------------------------------- modes

def run_forward(a: argparse.Namespace, rows: list[dict[str, Any]], shared: dict[str, Any]) -> None:
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    amp = contextlib.nullcontext
    model = build_model(a, dtype, a.seed).eval()
    calib = token_batch(a, a.calib_batch, a.seq, a.seed + 1)
    ids = token_batch(a, a.batch, a.seq, a.seed + 2)
    tokens = a.batch * a.seq
    energy = None if a.no_energy else Energy(dev)
    copies = {b: copy.deepcopy(model) for b in a.backends}
    if a.down_layout == "transposed" and "twell" in copies:
        import twell_compile

        twell_compile.prepare(copies["twell"], down_layout="transposed")
    compiled = {b: torch.compile(copies[b], dynamic=False, **compile_kwargs(b, a, None)) for b in a.backends}
    for d in a.density:
        achieved = calibrate(model, calib, d, amp, a.batch)
        for m in copies.values():
            copy_params(m, model)
        dens = measure_density(model, ids, amp)
        print_density(d, achieved, dens)
        run = stamp(dict(mode=a.mode, density_target=d, density_calibration=achieved, density_measured=dens,
                         density_measured_mean=statistics.mean(dens), backends={}, **shared), dev)
        rows.append(run)
        with torch.no_grad():
            ref = model(input_ids=ids, use_cache=False).logits
            fns = {"eager": lambda: model(input_ids=ids, use_cache=False).logits}
            fns.update({b: (lambda c=compiled[b]: c(input_ids=ids, use_cache=False).logits) for b in a.backends})

            def finish(name, first_s, base, peak, timing):
                fn = fns[name]
                # After the warm-up: twell's first calls probe the density on the dense path.
                mx, rel = logit_diff(fn(), ref)
                row = dict(median_ms=timing["median_ms"], min_ms=timing["min_ms"], max_ms=timing["max_ms"],
                           reps=timing["reps"], tokens_per_s=tokens / (timing["median_ms"] / 1e3),
                           first_call_s=first_s, max_abs_logit_diff_vs_eager=mx, rel_l2_logit_diff_vs_eager=rel,
                           peak_mem_bytes=peak, peak_above_resident_bytes=None if peak is None else peak - base,
                           **(energy_fields(timing, tokens * timing["reps"], energy, "--no-energy") if a.rounds == 1
                              else dict(energy_j_per_token=None,
                                        energy_reason="--rounds: backends interleaved, energy not split by backend")))
                if name == "twell":
                    row["twell_layer_density"] = twell_stats_density()
                    row["twell_sparse_layers_by_policy"] = twell_sparse_layers(row["twell_layer_density"], a.hidden, a.ffn,
                                                                                 a.batch * a.seq)
                run["backends"][name] = row
                print(f"  {name:>8}: {row['median_ms']:8.2f} ms  {row['tokens_per_s']:12.0f} tok/s  "
                      f"max|dlogit| {mx:.3g}  rel {rel:.2e}  first call {first_s:.1f} s  "
                      f"energy/token {row['energy_j_per_token']}", flush=True)
                write(a.out, rows)

            warmed = {}
            for name, fn in fns.items():
                if name == "twell":
                    reset_twell_policy()
                t0 = time.perf_counter()
                fn()
                sync(dev)
                first_s = time.perf_counter() - t0  # compile included
                reset_peak(dev)
                base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
                if a.rounds == 1:
                    timing = time_calls(fn, dev, a.warmup, a.reps, energy)
                    finish(name, first_s, base, peak_memory(dev), timing)
                else:       # warmed up here (its peak over these calls), timed below with the others
                    for _ in range(a.warmup):
                        fn()
                    sync(dev)
                    warmed[name] = (first_s, base, peak_memory(dev))
            if warmed:
                timings, by_round = interleaved_calls({n: fns[n] for n in warmed}, dev, a.reps, a.rounds)
                run["rounds_ms"] = by_round
                for name, (first_s, base, peak) in warmed.items():
                    finish(name, first_s, base, peak, dict(timings[name], energy_j=None))
            del ref
        b = run["backends"]
        if "inductor" in b and "twell" in b:
            run["speedup_twell_over_inductor"] = b["inductor"]["median_ms"] / b["twell"]["median_ms"]
            print(f"  twell / inductor: {run['speedup_twell_over_inductor']:.3f}x tokens/s", flush=True)
            if "rounds_ms" in run:
                per = sorted(r["inductor"] / r["twell"] for r in run["rounds_ms"])
                run["speedup_twell_over_inductor_by_round"] = per
                print(f"  per round: {' '.join(f'{v:.3f}' for v in per)}x (median {statistics.median(per):.3f})",
                      flush=True)
        write(a.out, rows)


class StepTimer:
    """A logits processor: HF calls it once per generated token; it records the time of each."""

    def __init__(self, device: torch.device):
        self.device = device
        self.marks: list[Any] = []

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())
        return scores

    def decode_ms(self) -> float:
        """From the first generated token's logits (prefill done) to the last one's."""
        if self.device.type == "cuda":
            self.marks[-1].synchronize()
            return self.marks[0].elapsed_time(self.marks[-1])
        return (self.marks[-1] - self.marks[0]) * 1e3


# untimed steps at the start of each round: a new cache (new static addresses) makes the first
# compiled steps re-record CUDA graphs; the round's time is the steady state after them (H200,
# batch 1, `--generate --step-loop --batch 1 --seq 128 --new-tokens 128 --density 0.005`:
# 1.262x with them, 1.12-1.22x without; 2026-11-23)
STEP_LOOP_WARM = 3


def step_loop_ms(m, compiled, prompt: torch.Tensor, steps: int, reps: int) -> float:
    """Median time (ms) per step of ``steps`` greedy one-token forwards of ``compiled`` (the
    model compiled as generate() compiles it) over a static KV cache after an eager prefill,
    the first STEP_LOOP_WARM of each round untimed: the next token and its position stay on
    the device and nothing syncs inside the loop, so the time is the GPU's per-step work plus
    what the host cannot hide (guards, graph replay). What generate() adds per step (logits
    processors, stopping criteria, its own syncs) is not in it."""
    # (parse_args makes sure steps > STEP_LOOP_WARM)
    import transformers

    dev = prompt.device
    b, length = prompt.shape
    times = []
    for r in range(reps + 2):           # 2 warm-up rounds: compile, record CUDA graphs
        cache = transformers.StaticCache(config=m.config, max_cache_len=length + steps + 1)
        with torch.no_grad():
            out = m(input_ids=prompt, past_key_values=cache, use_cache=True,
                    cache_position=torch.arange(length, device=dev))
            tok = out.logits[:, -1:].argmax(-1)
            pos = torch.full((1,), length, device=dev, dtype=torch.long)
            for i in range(steps):
                if i == STEP_LOOP_WARM:
                    sync(dev)
                    t0 = time.perf_counter()
                out = compiled(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos)
                tok = out.logits[:, -1:].argmax(-1)
                pos = pos + 1
            sync(dev)
        if r >= 2:
            times.append((time.perf_counter() - t0) * 1e3 / (steps - STEP_LOOP_WARM))
    return statistics.median(times)


def run_generate(a: argparse.Namespace, rows: list[dict[str, Any]], shared: dict[str, Any]) -> None:
    import transformers

    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    amp = contextlib.nullcontext
    model = build_model(a, dtype, a.seed).eval()
    calib = token_batch(a, a.calib_batch, a.seq, a.seed + 1)
    prompt = token_batch(a, a.batch, a.seq, a.seed + 2)
    mask = torch.ones_like(prompt)
    energy = None if a.no_energy else Energy(dev)
    # CUDA graphs exist only on CUDA; --compile-mode default: no CUDA graphs around the step
    mode = "reduce-overhead" if dev.type == "cuda" and a.compile_mode == "reduce-overhead" else None
    decode_tokens = a.batch * (a.new_tokens - 1)
    for d in a.density:
        achieved = calibrate(model, calib, d, amp, max(a.batch, 16))   # 16 sequences per forward
        dens = measure_density(model, prompt, amp)
        print_density(d, achieved, dens)
        run = stamp(dict(mode=a.mode, density_target=d, density_calibration=achieved, density_measured=dens,
                         density_measured_mean=statistics.mean(dens), backends={}, **shared), dev)
        rows.append(run)
        ref_ids = None
        for name in ["eager"] + a.backends:
            m = model if name == "eager" else copy.deepcopy(model)
            kw: dict[str, Any] = dict(attention_mask=mask, max_new_tokens=a.new_tokens,
                                      do_sample=False, cache_implementation="static")
            if name == "eager":
                kw["disable_compile"] = True
            else:
                cc = transformers.CompileConfig(**compile_kwargs(name, a, mode))
                cc._compile_all_devices = dev.type != "cuda"  # HF's flag to auto-compile off CUDA
                kw["compile_config"] = cc
            if name == "twell":
                reset_twell_policy()
            timers: list[StepTimer] = []

            def gen():
                t = StepTimer(dev)
                timers.append(t)
                with torch.no_grad():
                    return m.generate(prompt, logits_processor=transformers.LogitsProcessorList([t]), **kw)

            reset_peak(dev)
            resident = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
            t0 = time.perf_counter()
            out = gen()
            sync(dev)
            first_s = time.perf_counter() - t0
            timers.clear()
            timing = time_calls(gen, dev, a.warmup, a.reps, energy)
            decode = [t.decode_ms() for t in timers[-timing["reps"]:]]
            med = statistics.median(decode)
            new = out[:, prompt.shape[1]:]
            if ref_ids is None:
                ref_ids = new
            same = (new == ref_ids)
            agree = same.cumprod(dim=1).sum(dim=1)  # leading tokens equal to eager's, per sequence
            k = min(16, a.new_tokens)
            row = dict(decode_median_ms=med, decode_tokens_per_s=decode_tokens / (med / 1e3),
                       decode_ms_per_step=med / (a.new_tokens - 1), generate_median_ms=timing["median_ms"],
                       reps=timing["reps"], first_call_s=first_s,
                       greedy_same_as_eager_first_k=bool(same[:, :k].all()), greedy_k=k,
                       greedy_leading_agreement=[int(v) for v in agree],
                       greedy_token_agreement=float(same.float().mean()),
                       peak_mem_bytes=peak_memory(dev), resident_before_bytes=resident,
                       peak_above_resident_bytes=None if resident is None else peak_memory(dev) - resident,
                       **energy_fields(timing, a.batch * a.new_tokens * timing["reps"], energy, "--no-energy"))
            if row["energy_j_per_token"] is not None:
                row["energy_note"] = "whole generate() calls (prefill included) per generated token"
            if a.step_loop and name != "eager":
                compiled = m.get_compiled_call(kw["compile_config"])
                per_step = step_loop_ms(m, compiled, prompt, a.new_tokens - 1, max(3, a.reps))
                row.update(step_loop_ms_per_step=per_step, step_loop_tokens_per_s=a.batch / (per_step / 1e3))
                del compiled
                print(f"  {name:>8}: step loop {row['step_loop_tokens_per_s']:10.0f} tok/s "
                      f"({row['step_loop_ms_per_step']:.3f} ms/step)", flush=True)
            if name == "twell":
                row["twell_layer_density"] = twell_stats_density()
            run["backends"][name] = row
            print(f"  {name:>8}: decode {row['decode_tokens_per_s']:10.0f} tok/s ({row['decode_ms_per_step']:.3f} "
                  f"ms/step)  generate {timing['median_ms']:.1f} ms  first {first_s:.1f} s  greedy first {k} "
                  f"same as eager: {row['greedy_same_as_eager_first_k']} (leading {row['greedy_leading_agreement']})",
                  flush=True)
            write(a.out, rows)
            if m is not model:
                # the compiled copy and its CUDA-graph pool would otherwise stay resident and
                # count in the next backend's peak (H200, 2026-11-22: twell's 6.2 GB vs Inductor's
                # 3.9 GB at batch 1 held Inductor's 1.9 GB copy)
                del m, out, timers
                if name != "eager":
                    torch._dynamo.reset()
                gc.collect()                     # modules hold reference cycles
        b = run["backends"]
        if "inductor" in b and "twell" in b:
            ratio = b["twell"]["decode_tokens_per_s"] / b["inductor"]["decode_tokens_per_s"]
            run["speedup_twell_over_inductor"] = ratio
            print(f"  twell / inductor: {run['speedup_twell_over_inductor']:.3f}x decode tokens/s", flush=True)
            if a.step_loop:
                run["step_loop_speedup_twell_over_inductor"] = (b["twell"]["step_loop_tokens_per_s"]
                                                               / b["inductor"]["step_loop_tokens_per_s"])
                print(f"  twell / inductor: {run['step_loop_speedup_twell_over_inductor']:.3f}x step-loop tokens/s",
                      flush=True)
        write(a.out, rows)


def run_train(a: argparse.Namespace, rows: list[dict[str, Any]], shared: dict[str, Any]) -> None:
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    # one batch per step: the same one (--data fixed) or fresh text, the same for every backend
    batches = (text_batches(a, a.steps, a.batch, a.seq, a.seed + 2) if a.data == "text"
               else token_batch(a, a.batch, a.seq, a.seed + 2).unsqueeze(0).expand(a.steps, -1, -1))
    ids = batches[0]
    tokens = a.batch * a.seq
    wdt = torch.bfloat16 if a.pure_bf16 else torch.float32
    step_amp = contextlib.nullcontext if a.pure_bf16 else amp
    for d in a.density:
        master, achieved = calibrated_model(a, amp, d)
        dens = measure_density(master, ids, amp)
        print_density(d, achieved, dens)
        state = cpu_state(master)
        del master
        run = stamp(dict(mode=a.mode, density_target=d, density_calibration=achieved, density_measured=dens,
                         density_measured_mean=statistics.mean(dens),
                         autocast="bfloat16" if cuda and not a.pure_bf16 else None,
                         weights=str(wdt).replace("torch.", ""), backends={}, **shared), dev)
        rows.append(run)
        for name in ["eager"] + a.backends:
            model, opt, fwd = training_setup(a, state, name, wdt)
            # the same schedule for every backend: lr x min(1, (step + 1) / --lr-warmup)
            sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / a.lr_warmup))
                     if a.lr_warmup else None)
            reset_peak(dev)
            resident = torch.cuda.memory_allocated(dev) if cuda else None
            losses, step_ms, pending, history = [], [], [], []
            # each twell step's per-layer density, kept on the device (read after the loop)
            for ids in batches:
                t0 = time.perf_counter()
                if cuda:
                    ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    ev[0].record()
                with step_amp():
                    loss = fwd(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                opt.step()
                if sched is not None:
                    sched.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach())
                if cuda:
                    ev[1].record()
                    pending.append(ev)
                else:
                    step_ms.append((time.perf_counter() - t0) * 1e3)
                if name == "twell":
                    history.append(twell_layer_densities())
            sync(dev)
            if cuda:
                step_ms = [s.elapsed_time(e) for s, e in pending]
            timed = step_ms[min(2, a.steps - 1):]  # step 1 compiles, step 2 allocates AdamW state
            row = dict(step_median_ms=statistics.median(timed), step_ms=step_ms,
                       tokens_per_s=tokens / (statistics.median(timed) / 1e3),
                       losses=[float(v) for v in losses], peak_mem_bytes=peak_memory(dev),
                       resident_before_bytes=resident)
            if name == "twell":
                row["twell_layer_density"] = twell_stats_density()
                row["twell_layer_dead_units"] = twell_dead_units()
                row.update(density_fields(history, a.twell_options.get("twell.target_density")))
                if "twell_worst_rel_dev_from_step_20" in row:
                    print(f"  {name:>8}: worst per-layer density from step 20: "
                          f"{row['twell_worst_rel_dev_from_step_20']:+.1%} of the target", flush=True)
            run["backends"][name] = row
            print(f"  {name:>8}: step {row['step_median_ms']:9.2f} ms  peak {row['peak_mem_bytes']}  loss "
                  f"{row['losses'][0]:.4f} -> {row['losses'][-1]:.4f}", flush=True)
            del model, opt, fwd
            if name != "eager":
                torch._dynamo.reset()
            gc.collect()           # as --generate: nothing of this backend stays resident
            write(a.out, rows)
        b = run["backends"]
        ref = b["eager"]["losses"]
        for name in a.backends:
            b[name]["max_abs_loss_diff_vs_eager"] = max(abs(x - y) for x, y in zip(b[name]["losses"], ref))
        if "inductor" in b and "twell" in b:
            run["speedup_twell_over_inductor"] = b["inductor"]["step_median_ms"] / b["twell"]["step_median_ms"]
            if cuda:
                run["peak_mem_twell_over_inductor"] = b["twell"]["peak_mem_bytes"] / b["inductor"]["peak_mem_bytes"]
            print(f"  twell / inductor: {run['speedup_twell_over_inductor']:.3f}x step speed", flush=True)
        write(a.out, rows)


def summary(mode: str, device: str, rows: list[dict[str, Any]]) -> None:
    key = {"forward": ("median_ms", "tokens_per_s"), "generate": ("decode_ms_per_step", "decode_tokens_per_s"),
           "train": ("step_median_ms", "tokens_per_s")}[mode]
    print(f"\n{mode} on {device}: {key[0]} / {key[1]} per backend")
    for run in rows:
        cells = "  ".join(f"{n} {r[key[0]]:.3f} / {r[key[1]]:.0f}" for n, r in run["backends"].items())
        speed = run.get("speedup_twell_over_inductor")
        print(f"density {run['density_target']} (measured {run['density_measured_mean']:.4f}): {cells}"
              + (f"  twell/inductor {speed:.3f}x" if speed else ""))


def main(argv=None) -> list[dict[str, Any]]:
    a = parse_args(argv)
    a.out = str(out_path(a.out, gpu_name() if a.device.startswith("cuda") else "cpu", f"e2e_{a.mode}.json"))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
    config = {k: v for k, v in vars(a).items() if k not in ("twell_opt",)}
    # every row carries the run's flags and environment: a row read alone says how it was made
    shared = dict(config=config, env=env_info(a))
    rows: list[dict[str, Any]] = []
    print(f"bench_e2e --{a.mode}: {a.layers} layers, hidden {a.hidden}, ffn {a.ffn}, vocab {a.vocab}, "
          f"batch {a.batch} x seq {a.seq}, {a.dtype if a.mode != 'train' else 'bfloat16' if a.pure_bf16 else 'float32+autocast'} on "
          f"{shared['env']['device']}", flush=True)
    import twell_compile

    from twell_compile.runtime import arch

    twell_compile.reset_stats()     # report only this run's layers (stats are process-wide)
    with arch.patched(**policy_changes(a.policy)):
        {"forward": run_forward, "generate": run_generate, "train": run_train}[a.mode](a, rows, shared)
    write(a.out, rows)
    summary(a.mode, shared["env"]["device"], rows)
    print(f"wrote {a.out}")
    return rows


if __name__ == "__main__":
    main()
