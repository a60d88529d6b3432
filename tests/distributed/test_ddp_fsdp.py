"""Two CPU processes (gloo): DDP and FSDP2 around a model compiled with backend="twell".

Checks that the FFNs are rewritten inside each rank's graphs and that the gradients equal a
single process's. DDP's graph splitting at bucket boundaries (DDPOptimizer) is recorded as it
is today: with buckets smaller than an FFN the split leaves FFNs to Inductor (exact, no gain).
"""

import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not dist.is_available() or sys.platform != "linux", reason="needs torch.distributed")


class MLP(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(k, n), nn.Linear(k, n), nn.Linear(n, k)

    def forward(self, x):
        return self.down(F.relu(self.gate(x)) * self.up(x))


class Net(nn.Module):
    def __init__(self, k=256, n=1024):
        super().__init__()
        self.blocks = nn.ModuleList(MLP(k, n) for _ in range(2))
        self.head = nn.Linear(k, 8)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _worker(rank, world, port, wrap, bucket_mb, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import twell_compile.report as report_mod

    layers = []
    add = report_mod.Report.add_rewrite
    report_mod.Report.add_rewrite = lambda self, e: (layers.append(e.layer), add(self, e))[1]
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(8, 5, 256, generator=torch.Generator().manual_seed(1)).chunk(world)[rank]
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net, bucket_cap_mb=bucket_mb)
    else:
        from torch.distributed.fsdp import fully_shard

        for b in net.blocks:
            fully_shard(b)
        model = fully_shard(net)
    torch.compile(model, backend="twell")(x).square().mean().backward()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    if rank == 0:
        torch.save({"layers": layers, "grads": [g.detach().clone() for g in grads]}, out_path)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(wrap, bucket_mb, tmp_path, check_grads=True):
    out = tmp_path / "rank0.pt"
    torch.multiprocessing.spawn(_worker, args=(2, _free_port(), wrap, bucket_mb, str(out)), nprocs=2)
    got = torch.load(out)
    if not check_grads:
        return got["layers"]
    torch.manual_seed(0)
    ref = Net()
    x = torch.randn(8, 5, 256, generator=torch.Generator().manual_seed(1))
    (sum(ref(part).square().mean() for part in x.chunk(2)) / 2).backward()
    for g, p in zip(got["grads"], ref.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=1e-5)
    return got["layers"]


def test_fsdp2_per_block_keeps_the_rewrite(tmp_path):
    assert len(_run("fsdp", None, tmp_path)) == 2


@pytest.mark.parametrize("bucket_mb", [25, 1])
def test_ddp_gradients_match_one_process(bucket_mb, tmp_path):
    _run("ddp", bucket_mb, tmp_path)


@pytest.mark.xfail(strict=True, reason="issue 8: DDPOptimizer splits the graph at bucket boundaries "
                   "before the backend sees it (measured: 25 MB buckets keep 1 FFN of 2, 1 MB keep 0); "
                   "gradients stay exact, the split FFNs run on Inductor")
@pytest.mark.parametrize("bucket_mb", [25, 1])
def test_ddp_keeps_every_rewrite(bucket_mb, tmp_path):
    assert len(_run("ddp", bucket_mb, tmp_path, check_grads=False)) == 2
