"""Sharded data parallelism (ZeRO-3 / FSDP style): every nn.Linear sharded by rows, one step checked against
the data-parallel average of the full model's gradients.

Run: torchrun --nproc-per-node 2 docs/examples/sharded_dp.py
"""

import copy

import torch
import torch.distributed as dist
from torch import nn

from flashpar.overlap import ShardedLinear, average_replicated_grads, shard_linears


def batch(rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))   # rank r's own batch


def main(rank: int, world: int) -> None:
    torch.manual_seed(0)                                          # every rank the same model
    full = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 16))
    model = shard_linears(copy.deepcopy(full), group=None, mode="flash")   # every nn.Linear -> its ShardedLinear
    assert isinstance(shard_linears(nn.Linear(16, 8)), ShardedLinear)     # a bare nn.Linear: its ShardedLinear

    loss = model(batch(rank)).mean()                              # each rank its own batch
    loss.backward()
    average_replicated_grads(model, group=None)                   # norms, embeddings: plain all-reduce

    # the reference: the full model on every rank's batch, gradients averaged over ranks
    sum(full(batch(r)).mean() for r in range(world)).div(world).backward()
    rows = torch.tensor_split(torch.arange(64), world)[rank]      # this rank's rows of the first layer
    # same products, other summation order: fp32 agrees to ~1e-6
    torch.testing.assert_close(model[0].weight.grad, full[0].weight.grad[rows], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model[1].weight.grad, full[1].weight.grad, rtol=1e-5, atol=1e-6)
    if rank == 0:
        print(f"sharded_dp: the sharded MLP's weight gradients equal the full model's on {world} ranks (fp32)")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()
