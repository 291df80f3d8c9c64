"""FlashOverlap: collectives decomposed into point-to-point transfers, GEMMs ordered so no tail is exposed."""

from flashpar.overlap.modules import ColumnParallelLinear, RowParallelLinear
from flashpar.overlap.ops import all_gather_matmul, matmul_reduce_scatter
from flashpar.overlap.sharded import ShardedLinear, average_replicated_grads, shard_linears, sharded_linear

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ShardedLinear",
    "all_gather_matmul",
    "average_replicated_grads",
    "matmul_reduce_scatter",
    "shard_linears",
    "sharded_linear",
]
