"""FlashOverlap: collectives decomposed into point-to-point transfers, GEMMs ordered so no tail is exposed."""

from flashpar.overlap.a2a import all_to_all_matmul, matmul_all_to_all
from flashpar.overlap.modules import ColumnParallelLinear, RowParallelLinear
from flashpar.overlap.ops import all_gather_matmul, matmul_reduce_scatter
from flashpar.overlap.sharded import ShardedLinear, average_replicated_grads, shard_linears, sharded_linear
from flashpar.overlap.ulysses import UlyssesAttention

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ShardedLinear",
    "UlyssesAttention",
    "all_gather_matmul",
    "all_to_all_matmul",
    "average_replicated_grads",
    "matmul_all_to_all",
    "matmul_reduce_scatter",
    "shard_linears",
    "sharded_linear",
]
