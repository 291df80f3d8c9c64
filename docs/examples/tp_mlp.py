"""Tensor + sequence parallel MLP: all-gather + GEMM, then GEMM + reduce-scatter, checked against the full MLP.

Run: torchrun --nproc-per-node 2 docs/examples/tp_mlp.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flashpar.overlap import ColumnParallelLinear, RowParallelLinear, all_gather_matmul, matmul_reduce_scatter


def main(rank: int, world: int) -> None:
    s, hidden = 8 * world, 16                        # tokens, hidden size
    torch.manual_seed(0)                             # every rank builds the same full MLP and input
    fc1, fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
    x = torch.randn(s, hidden)
    x_shard = x.chunk(world)[rank]                   # [s/N, h]: this rank's sequence block

    # functional: w_col [4h/N, h] (this rank's rows of fc1), w_row [h, 4h/N] (its columns of fc2)
    w_col, b_col = fc1.weight.chunk(world)[rank], fc1.bias.chunk(world)[rank]
    w_row, b_row = fc2.weight.chunk(world, dim=1)[rank], fc2.bias   # the row-parallel bias is replicated
    a = all_gather_matmul(x_shard, w_col, b_col, group=None, mode="flash")     # [s, 4h/N]
    y_shard = matmul_reduce_scatter(F.gelu(a), w_row, b_row, group=None)       # [s/N, h]

    # or as modules, converted from the full nn.Linear layers (so a model can be checked against itself)
    col = ColumnParallelLinear.from_linear(fc1, group=None, mode="auto")
    row = RowParallelLinear.from_linear(fc2, group=None, mode="auto")
    y_mod = row(F.gelu(col(x_shard)))

    # the same products as the full MLP, summed in another order: fp32 agrees to ~1e-6
    y_full = fc2(F.gelu(fc1(x))).chunk(world)[rank]
    torch.testing.assert_close(y_shard, y_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_mod, y_full, rtol=1e-5, atol=1e-5)
    if rank == 0:
        print(f"tp_mlp: the overlapped MLP, functional and as modules, equals the full MLP on {world} ranks (fp32)")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()
