"""Two CPU processes (gloo): twell.target_density under DDP and FSDP2 gives every rank the same
coefficients, though each rank sees data of another density (control.py all-reduces the counts)."""

import os
import sys

import pytest
import torch
import torch.distributed as dist

from tests.distributed.test_ddp_fsdp import WORLD, Net, batch, free_port

pytestmark = pytest.mark.skipif(not dist.is_available() or sys.platform != "linux", reason="needs torch.distributed")
STEPS = 8


def _train(rank, wrap):
    import twell_compile
    from twell_compile import control

    twell_compile.reset_controller()
    twell_compile.reset_stats()
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = Net()
    twell_compile.prepare(net, options={"twell.target_density": 0.05, "twell.skip_dense": False})
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net)
    else:
        from torch.distributed.fsdp import fully_shard

        for b in net.blocks:
            fully_shard(b)
        model = fully_shard(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = batch().chunk(WORLD)[rank] * (1 + 2 * rank)          # rank 1: a busier gate input
    compiled = torch.compile(model, backend="twell", options={"twell.skip_dense": False})
    coefs, dens = [], []
    for _ in range(STEPS):
        compiled(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        coefs.append([float(control.coefficient(f"blocks.{i}.mlp")) for i in range(2)])
        dens.append([s.density for s in twell_compile.layer_stats().values()])
    return coefs, dens


def _worker(rank, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    torch.save({wrap: _train(rank, wrap) for wrap in ("ddp", "fsdp")}, f"{out_path}.{rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ctl") / "result"
    torch.multiprocessing.spawn(_worker, args=(free_port(), str(out)), nprocs=WORLD)
    return [torch.load(f"{out}.{r}") for r in range(WORLD)]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_every_rank_applies_the_same_coefficients(wrap, runs):
    (c0, d0), (c1, d1) = runs[0][wrap], runs[1][wrap]
    assert d0[-1] != d1[-1]                     # the ranks measured different densities
    assert c0 == c1                             # and hold bit-identical coefficients
    assert c0[-1] != c0[0]                      # which moved
