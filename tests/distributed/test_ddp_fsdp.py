"""Two CPU processes (gloo): DDP and FSDP2 around a model compiled with backend="twell".

One spawn runs every scenario (process-group start-up and imports are most of the cost); each
scenario records, per rank, the FFNs the backend rewrote or left (with reasons), the rank's
``explain`` report, the loss and the gradients. The tests compare them with one process
running the plain eager model.

Scenarios: DDP with default buckets (25 MB; DDP's first bucket is 1 MB) and with 1 MB buckets,
each with and without ``twell_compile.prepare``; FSDP2 ``fully_shard`` per block, with and
without ``prepare``. Without ``prepare`` DDP's graph split cuts FFNs apart (left to Inductor,
exact, reported with the fix); with it every FFN stays one op.
"""

import logging
import os
import re
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from twell_compile.testing import Block, GatedMLP

pytestmark = pytest.mark.skipif(not dist.is_available() or sys.platform != "linux", reason="needs torch.distributed")

K, N, WORLD = 256, 1024, 2
SCENARIOS = {   # name: (wrap, bucket_cap_mb, prepare)
    "ddp-default": ("ddp", 25, False),
    "ddp-1mb": ("ddp", 1, False),
    "ddp-default-prepared": ("ddp", 25, True),
    "ddp-1mb-prepared": ("ddp", 1, True),
    "fsdp2-block": ("fsdp", None, False),
    "fsdp2-block-prepared": ("fsdp", None, True),
}


class Net(nn.Module):
    def __init__(self, k=K, n=N):
        super().__init__()
        self.blocks = nn.ModuleList(Block(GatedMLP(k, n, bias=True), k) for _ in range(2))
        self.head = nn.Linear(k, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def batch():
    return torch.randn(8, 5, K, generator=torch.Generator().manual_seed(1))


class Seen(logging.Handler):
    """What the backend rewrote, (layer, op, via), and left to Inductor, (layer, reason): read
    from its log, the INFO lines of the "twell_compile" logger."""

    REWROTE = re.compile(r"twell: rewrote (\S+) \(.*\) -> (\S+?)( \(prepared\))?(: .*)?$")
    LEFT = re.compile(r"twell: left (\S+) to Inductor: (.*)$", re.S)

    def __init__(self):
        super().__init__(logging.INFO)
        self.seen = {"rewrites": [], "rejections": []}

    def emit(self, record):
        text = record.getMessage()
        if m := self.REWROTE.match(text):
            self.seen["rewrites"].append((m[1], m[2], "prepare" if m[3] else "graph"))
        elif m := self.LEFT.match(text):
            self.seen["rejections"].append((m[1], m[2]))


def _scenario(rank, wrap, bucket_mb, prepare):
    import twell_compile

    log = logging.getLogger("twell_compile")
    handler, level = Seen(), log.level
    seen = handler.seen
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        torch._dynamo.reset()
        torch.manual_seed(0)
        net = Net()
        if prepare:
            assert len(twell_compile.prepare(net, options={"twell.skip_dense": False}).rewrites) == 2
        x = batch().chunk(WORLD)[rank]
        if wrap == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(net, bucket_cap_mb=bucket_mb)
        else:
            from torch.distributed.fsdp import fully_shard

            for b in net.blocks:
                fully_shard(b)
            model = fully_shard(net)
        seen["rewrites"].clear(), seen["rejections"].clear()
        # every FFN rewritten (CPU training would otherwise stay with Inductor: no twell.l1 here)
        loss = torch.compile(model, backend="twell", options={"twell.skip_dense": False})(x).square().mean()
        loss.backward()
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
        backend_seen = {k: list(v) for k, v in seen.items()}
        torch._dynamo.reset()
        with torch.no_grad():
            report = twell_compile.explain(model, x, options={"twell.skip_dense": False})
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return {"backend": backend_seen, "loss": loss.detach(), "grads": [g.detach().clone() for g in grads],
            "explain": {"rank": report.rank, "graphs": report.graphs, "text": str(report),
                        "rewrites": [(r.layer, r.via) for r in report.rewrites],
                        "rejections": [(r.layer, r.reason) for r in report.rejections]}}


def _worker(rank, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    results = {name: _scenario(rank, *args) for name, args in SCENARIOS.items()}
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "result"
    torch.multiprocessing.spawn(_worker, args=(free_port(), str(out)), nprocs=WORLD)
    return [torch.load(f"{out}.{r}") for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference():
    """One process, plain eager model: loss per rank's shard and the averaged gradients."""
    torch.manual_seed(0)
    ref = Net()
    parts = batch().chunk(WORLD)
    losses = [ref(part).square().mean() for part in parts]
    (sum(losses) / WORLD).backward()
    return [loss.detach() for loss in losses], [p.grad.clone() for p in ref.parameters()]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_loss_and_gradients_equal_one_process(name, runs, reference):
    losses, grads = reference
    for rank, run in enumerate(runs):
        got = run[name]
        torch.testing.assert_close(got["loss"], losses[rank], atol=1e-6, rtol=1e-5)
        assert len(got["grads"]) == len(grads)
        for g, ref in zip(got["grads"], grads):
            torch.testing.assert_close(g, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["ddp-default-prepared", "ddp-1mb-prepared", "fsdp2-block-prepared"])
def test_prepared_keeps_every_rewrite(name, runs):
    for run in runs:
        got = run[name]["backend"]
        assert sorted(got["rewrites"]) == [("blocks.0.mlp", "twell::ffn_train", "prepare"),
                                           ("blocks.1.mlp", "twell::ffn_train", "prepare")], got
        assert not got["rejections"], got


def test_fsdp2_per_block_keeps_the_rewrite_unprepared(runs):
    """FSDP2's hooks break the graph at each block: one graph per block, its FFN found whole
    (named relative to its block, "mlp"; prepared FFNs keep the model path)."""
    for run in runs:
        got = run["fsdp2-block"]["backend"]
        assert [op for _, op, _ in got["rewrites"]] == ["twell::ffn_train"] * 2 and not got["rejections"], got


@pytest.mark.parametrize("name", ["ddp-default", "ddp-1mb"])
def test_ddp_split_unprepared_reports_cut_ffns_with_the_fix(name, runs):
    """Without prepare, the bucket split cuts FFNs (25 MB: 1 of 2, DDP's first bucket is 1 MB;
    1 MB: both); every FFN is either rewritten or reported as cut, naming prepare."""
    for run in runs:
        got = run[name]["backend"]
        cut = [layer for layer, reason in got["rejections"] if "DDP's graph split" in reason]
        assert all("twell_compile.prepare(model)" in reason for _, reason in got["rejections"]), got
        assert cut, got
        assert sorted(cut + [layer for layer, _, _ in got["rewrites"]]) == ["blocks.0.mlp", "blocks.1.mlp"], got


def test_explain_reports_each_ranks_graphs(runs):
    for rank, run in enumerate(runs):
        split = run["ddp-1mb"]["explain"]
        assert split["rank"] == rank and split["graphs"] > 1, split["text"]
        assert f"on rank {rank}" in split["text"]
        assert any("DDP's graph split" in reason for _, reason in split["rejections"]), split["text"]
        prepared = run["ddp-1mb-prepared"]["explain"]
        assert sorted(prepared["rewrites"]) == [("blocks.0.mlp", "prepare"), ("blocks.1.mlp", "prepare")], prepared["text"]
        assert not prepared["rejections"], prepared["text"]
