"""Train a ReLU Hugging Face Llama with DDP or FSDP2 plus torch.compile, on CPUs (gloo) or GPUs (NCCL).

    torchrun --nproc-per-node 2 examples/train_ddp.py --device cpu --tiny          # CPU, 2 processes
    torchrun --nproc-per-node 2 examples/train_ddp.py --wrap fsdp2 --backend twell  # 2 GPUs
    python3 examples/train_ddp.py --wrap none --accum 2 ...                          # 1 process, no wrapper

Each step prints the loss (mean over ranks) and the step time; at the end rank 0 prints one
JSON object: settings, per-step losses and times, median step time after the compile steps,
peak memory per rank, and per rank the FFNs the twell backend rewrote (prepared or found in
the graph) or left to Inductor with the reason (``--out``: the same object as the one row of a
results file, benchmarks/rows.py's fields first). With ``--backend twell`` the model is
``twell_compile.prepare``-d before wrapping (``--no-prepare`` shows what DDP's graph split does
without it). Tokens are random: this measures speed and memory, and that training runs; it
does not train a useful model. Every step draws one global batch of ``--global-batch``
sequences from one seeded generator (the same on every rank; ``--fixed-batch``: the first one
at every step, as bench_e2e --train does); rank r takes its share, cut into ``--accum``
micro-batches (gradient accumulation, ``--wrap none`` only). So 2 ranks x 4 sequences and 1
process x 2 micro-batches of 4 see the same tokens and average the same gradients (twell's
penalty included: each accumulated call gets ``--l1`` / k): their losses agree to rounding
(benchmarks/run_multi_gpu.sh compares them).

``--density D`` builds benchmarks/bench_e2e.py's model instead (``mlp_bias=True``, random
up/down biases, kv heads = heads) and calibrates every ``gate_proj.bias`` with bench_e2e's
``calibrate`` so that each neuron fires on about D of the tokens (rank 0 calibrates on
``--calib-batch`` sequences drawn apart from the training data, then broadcasts;
``--calib-cache FILE`` keeps the biases for later runs of the same model). Ranks start from
rank 0's weights (broadcast before wrapping).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import logging
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

import twell_compile

TINY = dict(hidden=64, layers=2, ffn=176, heads=4, vocab=256, seq=32, batch=4)
SIZED = dict(hidden=1024, layers=8, ffn=2816, heads=16, vocab=32000, seq=1024, batch=8)
ROOT = Path(__file__).resolve().parents[1]


class _Rewrites(logging.Handler):
    """Collects the twell backend's rewrite and rejection log records of this process."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.rewritten: list[str] = []
        self.left: list[list[str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        # report.add_rewrite's record: (layer, kind, dtype, N, K, tokens, op, prepared, runs)
        if record.msg.startswith("twell: rewrote") and record.args[6] != "prepared":   # not prepare's own report
            self.rewritten.append(f"{record.args[0]} -> {record.args[6]}{record.args[7]}")
        elif record.msg.startswith("twell: left"):
            self.left.append([str(record.args[0]), str(record.args[1])])


class _DDPBuckets(logging.Handler):
    """Counts the pieces Dynamo's DDPOptimizer splits each graph into (its INFO record)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.buckets: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "DDPOptimizer used bucket cap" in str(record.msg) and len(record.args or ()) >= 2:
            self.buckets.append(int(record.args[1]))


def build_model(size: dict[str, int], seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["ffn"],
                      num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                      num_key_value_heads=size["heads"], max_position_embeddings=size["seq"], hidden_act="relu",
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _rows():
    """benchmarks/rows.py, the results files' row schema (the checkout's root added to sys.path:
    run as a file, this script's own folder is sys.path[0])."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from benchmarks import rows

    return rows


def _bench_e2e():
    """benchmarks/bench_e2e.py as a module (its model and its gate-bias calibration)."""
    if "bench_e2e" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "benchmarks" / "bench_e2e.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_e2e"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["bench_e2e"]


def build_e2e_model(size: dict[str, int], seed: int, device: torch.device) -> torch.nn.Module:
    """bench_e2e's LlamaForCausalLM (mlp_bias, random up/down biases), fp32, built on `device`."""
    ns = argparse.Namespace(vocab=size["vocab"], hidden=size["hidden"], ffn=size["ffn"], layers=size["layers"],
                            heads=size["heads"], kv_heads=size["heads"], seq=size["seq"], new_tokens=0,
                            device=str(device))
    return _bench_e2e().build_model(ns, torch.float32, seed)


def _cache_key(size: dict[str, int], args: argparse.Namespace, model: torch.nn.Module) -> dict[str, Any]:
    w = model.model.layers[0].mlp.gate_proj.weight
    return {"size": {k: size[k] for k in ("hidden", "layers", "ffn", "heads", "vocab", "seq")}, "seed": args.seed,
            "density": args.density, "calib_batch": args.calib_batch, "calib_chunk": args.calib_chunk,
            "bf16": bool(args.bf16 and w.device.type == "cuda"), "device": w.device.type,
            "weight_sum": round(float(w.detach().double().sum()), 6)}


def calibrate_gate_biases(model: torch.nn.Module, size: dict[str, int], args: argparse.Namespace,
                          device: torch.device, amp: bool) -> dict[str, Any]:
    """Rank 0: bench_e2e.calibrate on --calib-batch sequences (seed + 1), or the biases from
    --calib-cache when it holds this model's; then every rank gets rank 0's gate biases."""
    gates = [layer.mlp.gate_proj.bias for layer in model.model.layers]
    info: dict[str, Any] = {}
    if dist.get_rank() == 0:
        key = _cache_key(size, args, model)
        cached = torch.load(args.calib_cache) if args.calib_cache and os.path.exists(args.calib_cache) else None
        if cached is not None and cached.get("key") == key:
            with torch.no_grad():
                for b, v in zip(gates, cached["gate_bias"]):
                    b.copy_(v.to(b.device))
            info = {"calibration_source": "cache", "density_calibration": cached["density_calibration"]}
        else:
            gen = torch.Generator().manual_seed(args.seed + 1)
            calib = torch.randint(0, size["vocab"], (args.calib_batch, size["seq"]), generator=gen).to(device)
            ctx = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if amp else contextlib.nullcontext
            t0 = time.perf_counter()
            achieved = _bench_e2e().calibrate(model, calib, args.density, ctx, max(1, args.calib_chunk))
            info = {"calibration_source": "calibrated", "calibration_s": round(time.perf_counter() - t0, 2),
                    "density_calibration": achieved}
            del calib
            if args.calib_cache:
                Path(args.calib_cache).parent.mkdir(parents=True, exist_ok=True)
                torch.save({"key": key, "gate_bias": [b.detach().cpu() for b in gates],
                            "density_calibration": achieved}, args.calib_cache)
    for b in gates:
        dist.broadcast(b.data, src=0)
    return info


def measure_density(model: torch.nn.Module, ids: torch.Tensor, amp: bool) -> list[float]:
    ctx = torch.autocast(ids.device.type, dtype=torch.bfloat16) if amp else contextlib.nullcontext()
    with ctx:
        return _bench_e2e().measure_density(model, ids, contextlib.nullcontext)


def wrap(model: torch.nn.Module, how: str, device: torch.device, bucket_cap_mb: Optional[float]) -> torch.nn.Module:
    if how == "none":
        return model
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        kw: dict[str, Any] = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **kw)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:       # per transformer block: the recommended use
        fully_shard(layer)
    return fully_shard(model)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux: KiB -> MiB (process RSS)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wrap", choices=["ddp", "fsdp2", "none"], default="ddp",
                    help="none: no wrapper, one process (reference for the wrapped runs)")
    ap.add_argument("--backend", choices=["twell", "inductor", "eager"], default="twell")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help=f"tiny model {TINY} (default: {SIZED})")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the median step time (compile)")
    ap.add_argument("--no-prepare", dest="prepare", action="store_false",
                    help="twell backend without twell_compile.prepare (DDP's graph split then cuts FFNs)")
    ap.add_argument("--l1", type=float, default=2e-5,
                    help="twell.l1 (paper's activation penalty) per step; with --accum k each call gets l1 / k")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="fp32 on CUDA (default: bf16 autocast)")
    ap.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket size (default: DDP's 25 MB)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the summary here as a results file of one row (benchmarks/rows.py; "
                                  "rank 0; rewritten after every step, 'complete': false until the end)")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="sequences per step over all ranks and micro-batches (default: batch x world x accum)")
    ap.add_argument("--fixed-batch", action="store_true",
                    help="train on the first global batch at every step (as bench_e2e --train): the loss falls "
                         "fast, so runs that differ in their gradients show it")
    ap.add_argument("--profile", type=int, default=0,
                    help="after the timed steps, this many more under torch.profiler (CPU + CUDA); one Chrome "
                         "trace per rank, --profile-dir/rank<r>.json.gz (benchmarks/trace_overlap.py reads them)")
    ap.add_argument("--profile-dir", default="traces", help="where --profile writes its traces")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step (gradient accumulation; --wrap none)")
    ap.add_argument("--density", type=float, default=None,
                    help="bench_e2e's model with gate biases calibrated to this density (e.g. 0.005)")
    ap.add_argument("--calib-batch", type=int, default=None, help="calibration sequences (default 256, 64 with --tiny)")
    ap.add_argument("--calib-chunk", type=int, default=8, help="calibration sequences per forward")
    ap.add_argument("--calib-cache", default=None, help="file keeping the calibrated gate biases across runs")
    for key in SIZED:
        ap.add_argument("--" + key, type=int, default=None, help="override the model/batch size")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.profile < 0:
        ap.error("--steps must be >= 1, --warmup and --profile >= 0")
    if args.accum < 1 or (args.accum > 1 and args.wrap != "none"):
        ap.error("--accum N > 1 needs --wrap none (no no_sync / FSDP2 gradient-sync handling here)")
    if args.density is not None and not 0.0 < args.density <= 1.0:
        ap.error("--density must be in (0, 1]")
    if args.calib_batch is None:
        args.calib_batch = 64 if args.tiny else 256
    return args


def _init_process_group(device: str) -> None:
    """Under torchrun: its env. Otherwise one process (world 1) on a free local port."""
    backend = "nccl" if device == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _limit_recompiles() -> None:
    """FSDP2 compiles each block's frame on its own; 16 blocks exceed Dynamo's default of 8
    graphs per code object (the rest would run eager). bench_e2e raises it the same way."""
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    size = dict(TINY if args.tiny else SIZED)
    size.update({k: getattr(args, k) for k in SIZED if getattr(args, k) is not None})
    _init_process_group(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.wrap == "none" and world > 1:
        raise SystemExit("--wrap none runs one process; use --wrap ddp or fsdp2 under torchrun")
    if args.global_batch is not None:
        if args.global_batch % (world * args.accum):
            raise SystemExit(f"--global-batch {args.global_batch} must divide by world x accum = {world * args.accum}")
        size["batch"] = args.global_batch // (world * args.accum)
    global_batch = size["batch"] * world * args.accum
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    _limit_recompiles()
    seen = _Rewrites()
    log = logging.getLogger("twell_compile")
    log.addHandler(seen)
    log.setLevel(logging.INFO)
    buckets = _DDPBuckets()
    if args.wrap == "ddp":
        ddp_log = logging.getLogger("torch._dynamo.backends.distributed")
        ddp_log.addHandler(buckets)
        ddp_log.setLevel(logging.INFO)
    amp = args.bf16 and device.type == "cuda"
    t_start = time.perf_counter()

    if args.density is not None:
        model = build_e2e_model(size, args.seed, device)
    else:
        model = build_model(size, args.seed).to(device)
    if world > 1:   # every rank starts from rank 0's weights (DDP checks this; FSDP2 shards what each rank has)
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=0)
    calib: dict[str, Any] = {}
    measured: Optional[list[float]] = None
    data = torch.Generator().manual_seed(args.seed)
    if args.density is not None:
        calib = calibrate_gate_biases(model, size, args, device, amp)
        if rank == 0:   # on the first step's first micro-batch, eager, before any rewrite
            first = torch.randint(0, size["vocab"], (global_batch, size["seq"]),
                                  generator=torch.Generator().manual_seed(args.seed))[:size["batch"]]
            measured = measure_density(model, first.to(device), amp)
            print(f"density target {args.density}: calibration mean "
                  f"{statistics.mean(calib['density_calibration']):.5f} ({calib['calibration_source']}); "
                  f"first batch mean {statistics.mean(measured):.5f}", flush=True)
    prep = None
    # twell.l1 is per call (docs/training.md): k accumulated micro-batches would apply it k times,
    # so each call gets l1 / k, the push one rank's call gives under DDP / FSDP2 (gradients averaged).
    l1_call = args.l1 / args.accum
    if args.backend == "twell" and args.prepare:
        prep = twell_compile.prepare(model, options={"twell.l1": l1_call})
    model = wrap(model, args.wrap, device, args.bucket_cap_mb)
    if args.backend == "twell":
        options = {} if args.prepare else {"twell.l1": l1_call, "twell.l1_layers": size["layers"]}
        run = torch.compile(model, backend="twell", options=options)
    elif args.backend == "inductor":
        run = torch.compile(model)
    else:
        run = model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if device.type == "cuda":   # the training run's peak (AdamW state included), not calibration's
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    setup_s = time.perf_counter() - t_start

    # the run's one results row (benchmarks/rows.py: gpu, torch, triton, commit, time first),
    # filled in as the steps go
    summary: dict[str, Any] = _rows().stamp({
        "wrap": args.wrap, "backend": args.backend, "prepare": bool(prep is not None), "device": str(device.type),
        "world": world, "bf16": amp, "l1": args.l1, "l1_per_call": l1_call, "size": size, "global_batch": global_batch,
        "accum": args.accum, "tokens_per_step": global_batch * size["seq"],
        "micro_batch_tokens": size["batch"] * size["seq"], "bucket_cap_mb": args.bucket_cap_mb,
        "steps": args.steps, "warmup": args.warmup, "fixed_batch": args.fixed_batch, "density_target": args.density,
        "density_calibration_mean": (round(statistics.mean(calib["density_calibration"]), 6)
                                     if calib.get("density_calibration") else None),
        "calibration_source": calib.get("calibration_source"), "calibration_s": calib.get("calibration_s"),
        "density_first_batch": [round(v, 6) for v in measured] if measured is not None else None,
        "setup_s": round(setup_s, 2), "complete": False,
    }, device)
    losses, times = [], []

    def write_out() -> None:
        if rank == 0 and args.out:
            _rows().write_json(args.out, [summary])

    def fill_times() -> None:
        timed = times[args.warmup:] or times
        summary.update({"losses": [round(v, 5) for v in losses], "step_ms": [round(t * 1e3, 2) for t in times],
                        "first_step_s": round(times[0], 2),
                        "median_step_ms": round(statistics.median(timed) * 1e3, 2),
                        "tokens_per_s": round(global_batch * size["seq"] / statistics.median(timed), 1)})

    def train_step(step: int) -> tuple[float, torch.Tensor]:
        """One optimizer step on this step's global batch: (seconds, summed loss as a 0-d tensor)."""
        nonlocal glob
        if step == 0 or not args.fixed_batch:
            glob = torch.randint(0, size["vocab"], (global_batch, size["seq"]), generator=data)
        mine = glob[rank * size["batch"] * args.accum:(rank + 1) * size["batch"] * args.accum].to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        total = None
        for ids in mine.split(size["batch"]):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                loss = run(input_ids=ids, labels=ids, use_cache=False).loss
            (loss / args.accum if args.accum > 1 else loss).backward()
            total = loss.detach().float() if total is None else total + loss.detach().float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0, total

    glob = None
    for step in range(args.steps):
        seconds, total = train_step(step)
        times.append(seconds)
        mean = total.clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / (world * args.accum))
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}  time {times[-1] * 1e3:8.1f} ms", flush=True)
            fill_times()
            summary["peak_memory_mb_rank0"] = round(peak_memory_mb(device), 1)
            write_out()
    if args.profile:   # after the timed steps: the profiler's cost stays out of the medians
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for step in range(args.steps, args.steps + args.profile):
                train_step(step)
                prof.step()
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(args.profile_dir) / f"rank{rank}.json.gz"))
        summary["profiled_steps"] = args.profile

    layer_density: dict[str, float] = {}
    if args.backend == "twell":
        try:
            layer_density = {k: round(v.density, 6) for k, v in twell_compile.layer_stats().items()}
        except Exception as e:  # statistics are a report, not the run
            layer_density = {"error": f"{type(e).__name__}: {e}"}
    graphs = int(torch._dynamo.utils.counters["stats"].get("unique_graphs", 0))
    mine_info = {"rank": rank, "peak_memory_mb": round(peak_memory_mb(device), 1),
                 "prepared": [r.layer for r in prep.rewrites] if prep is not None else [],
                 "rewritten": seen.rewritten, "left_to_inductor": seen.left, "dynamo_graphs": graphs,
                 "ddp_graph_pieces": buckets.buckets if args.wrap == "ddp" else None,
                 "twell_layer_density": layer_density}
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, mine_info)
    fill_times()
    summary.update({"ranks": per_rank, "peak_memory_mb_max": max(r["peak_memory_mb"] for r in per_rank),
                    "wall_s": round(time.perf_counter() - t_start, 2), "complete": True})
    if rank == 0:
        print(json.dumps(summary, indent=1))
        write_out()
    # The wrapper, its compiled graphs and the optimizer hold gloo work and tensors: freed here,
    # while the interpreter is alive, not during its finalisation (a SIGABRT there is the
    # failure mode of pytorch/pytorch#179291). Then the barrier: without it a rank may tear gloo
    # down while its peer still writes (1 in 3 two-rank FSDP2 CPU runs aborted at exit,
    # "terminate called without an active exception").
    del run, model, opt
    torch._dynamo.reset()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
