"""Train a ReLU Hugging Face Llama with DDP or FSDP2 plus torch.compile, on CPUs (gloo) or GPUs (NCCL).

    torchrun --nproc-per-node 2 examples/train_ddp.py --device cpu --tiny          # CPU, 2 processes
    torchrun --nproc-per-node 2 examples/train_ddp.py --wrap fsdp2 --backend twell  # 2 GPUs

Each step prints the loss (mean over ranks) and the step time; at the end rank 0 prints one
JSON object: settings, per-step losses and times, median step time after the compile steps,
peak memory per rank, and per rank the FFNs the twell backend rewrote (prepared or found in
the graph) or left to Inductor with the reason. With ``--backend twell`` the model is
``twell_compile.prepare``-d before wrapping (``--no-prepare`` shows what DDP's graph split does
without it). Tokens are random (a fixed seed per rank): this measures speed and memory, and
that training runs; it does not train a useful model.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

import twell_compile

TINY = dict(hidden=64, layers=2, ffn=176, heads=4, vocab=256, seq=32, batch=4)
SIZED = dict(hidden=1024, layers=8, ffn=2816, heads=16, vocab=32000, seq=1024, batch=8)


class _Rewrites(logging.Handler):
    """Collects the twell backend's rewrite and rejection log records of this process."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.rewritten: list[str] = []
        self.left: list[list[str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("twell: rewrote") and record.args[-2] != "prepared":   # not prepare's own report
            self.rewritten.append(f"{record.args[0]} -> {record.args[-2]}{record.args[-1]}")
        elif record.msg.startswith("twell: left"):
            self.left.append([str(record.args[0]), str(record.args[1])])


def build_model(size: dict[str, int], seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["ffn"],
                      num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                      num_key_value_heads=size["heads"], max_position_embeddings=size["seq"], hidden_act="relu",
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def wrap(model: torch.nn.Module, how: str, device: torch.device, bucket_cap_mb: Optional[float]) -> torch.nn.Module:
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
    ap.add_argument("--wrap", choices=["ddp", "fsdp2"], default="ddp")
    ap.add_argument("--backend", choices=["twell", "inductor", "eager"], default="twell")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help=f"tiny model {TINY} (default: {SIZED})")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the median step time (compile)")
    ap.add_argument("--no-prepare", dest="prepare", action="store_false",
                    help="twell backend without twell_compile.prepare (DDP's graph split then cuts FFNs)")
    ap.add_argument("--l1", type=float, default=2e-5, help="twell.l1 (paper's activation penalty)")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="fp32 on CUDA (default: bf16 autocast)")
    ap.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket size (default: DDP's 25 MB)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the JSON summary here (rank 0)")
    for key in SIZED:
        ap.add_argument("--" + key, type=int, default=None, help="override the model/batch size")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    size = dict(TINY if args.tiny else SIZED)
    size.update({k: getattr(args, k) for k in SIZED if getattr(args, k) is not None})
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    seen = _Rewrites()
    log = logging.getLogger("twell_compile")
    log.addHandler(seen)
    log.setLevel(logging.INFO)

    model = build_model(size, args.seed).to(device)
    prep = None
    if args.backend == "twell" and args.prepare:
        prep = twell_compile.prepare(model, options={"twell.l1": args.l1})
    model = wrap(model, args.wrap, device, args.bucket_cap_mb)
    if args.backend == "twell":
        options = {} if args.prepare else {"twell.l1": args.l1, "twell.l1_layers": size["layers"]}
        run = torch.compile(model, backend="twell", options=options)
    elif args.backend == "inductor":
        run = torch.compile(model)
    else:
        run = model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    amp = args.bf16 and device.type == "cuda"

    losses, times = [], []
    for step in range(args.steps):
        ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}  time {times[-1] * 1e3:8.1f} ms", flush=True)

    mine = {"rank": rank, "peak_memory_mb": round(peak_memory_mb(device), 1),
            "prepared": [r.layer for r in prep.rewrites] if prep is not None else [],
            "rewritten": seen.rewritten, "left_to_inductor": seen.left}
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, mine)
    timed = times[args.warmup:] or times
    summary = {
        "wrap": args.wrap, "backend": args.backend, "prepare": bool(prep is not None), "device": str(device.type),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "world": world,
        "torch": torch.__version__, "bf16": amp, "l1": args.l1, "size": size,
        "losses": [round(v, 5) for v in losses], "step_ms": [round(t * 1e3, 2) for t in times],
        "median_step_ms": round(statistics.median(timed) * 1e3, 2),
        "tokens_per_s": round(size["batch"] * size["seq"] * world / statistics.median(timed), 1),
        "ranks": per_rank,
    }
    if rank == 0:
        text = json.dumps(summary, indent=1)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
