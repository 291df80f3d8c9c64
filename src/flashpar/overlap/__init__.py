"""FlashOverlap: collectives decomposed into point-to-point transfers, GEMMs ordered so no tail is exposed.

The public ops load on first use (PEP 562), so the pure parts (``schedule``, ``rows``, ``simulate``)
import without torch.distributed.
"""

import importlib

_HOME = {
    "ColumnParallelLinear": "modules",
    "RowParallelLinear": "modules",
    "ShardedLinear": "sharded_modules",
    "all_gather_matmul": "ops",
    "all_to_all_matmul": "a2a",
    "average_replicated_grads": "sharded_modules",
    "build_schedule": "schedule",
    "matmul_all_to_all": "a2a",
    "matmul_reduce_scatter": "ops",
    "shard_linears": "sharded_modules",
    "sharded_linear": "sharded",
}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'flashpar.overlap' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"flashpar.overlap.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
