"""FlashOverlap: collectives decomposed into point-to-point transfers, GEMMs ordered so no tail is exposed."""

from flashpar.overlap.modules import ColumnParallelLinear, RowParallelLinear
from flashpar.overlap.ops import all_gather_matmul, matmul_reduce_scatter

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "all_gather_matmul", "matmul_reduce_scatter"]
