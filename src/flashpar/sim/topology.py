"""A cluster (GPUs per node; NVLink inside a node, InfiniBand between) and a (dp, cp, ulysses, tp) layout on it.

Ranks are numbered ``((d cp + c) U + u) tp + t``, as ``flashpar.train.loop.setup`` lays out its mesh (tp
innermost), and node ``k`` holds ranks ``[k G, (k + 1) G)`` (``G`` GPUs per node).  A group of one mesh dim
(its size ``n``, the product ``s`` of the dims inside it as its stride) spans the ranks ``s (n - 1) + 1`` wide,
so it stays inside a node when ``s n <= G`` (then every transfer rides NVLink) and crosses nodes otherwise
(a transfer then rides the InfiniBand port of each GPU; a collective is NCCL's, ``flashpar.cost.nccl``)::

    G = 8, layout (dp 4, cp 2, ulysses 1, tp 4):   node 0: ranks 0-7  = (d 0, c 0, t 0-3) (d 0, c 1, t 0-3)
        tp  stride 1, 4 wide   -> NVLink           node 1: ranks 8-15 = (d 1, ...)
        cp  stride 4, 8 wide   -> NVLink
        dp  stride 8, 32 wide  -> InfiniBand

``Hardware`` per group: ``flashpar.cost.group_hardware`` of its ranks, the device's figures (``--hardware``:
FLOP/s, memory) with the link of the group's kind (``--hardware``'s own link inside a node, ``--inter``'s between
nodes, with the nodes it spans): the function the runtime's ``mode="auto"`` asks with a process group's ranks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flashpar.cost import Hardware, group_hardware
from flashpar.dims import DIMS, ParallelDims

__all__ = ["DIMS", "Cluster", "Layout"]

class Layout(ParallelDims):
    """The mesh's sizes (``flashpar.dims.ParallelDims``: its rules), with the simulator's name for its size."""

    @property
    def gpus(self) -> int:
        return self.world_size


@dataclass(frozen=True)
class Cluster:
    """``gpus_per_node`` GPUs of ``device`` per node (NVLink among them: ``device``'s link figures), the nodes
    joined by ``inter``'s link figures (one port per GPU); ``spread``: how much the devices' step times differ
    (a synchronous step waits for the slowest: ``flashpar.sim.sync``)."""

    device: Hardware
    inter: Hardware
    gpus_per_node: int = 8
    device_name: str = "h100-nvlink"
    inter_name: str = "h100-ib"
    spread: float = 0.0  # the devices' spread of step time (flashpar.sim.sync; presets.STEP_SPREAD)

    def group(self, layout: Layout, dims: tuple[str, ...]) -> tuple[int, Hardware, str]:
        """(size, hardware, "nvlink" | "ib" | "-") of the group spanning mesh dims ``dims`` (e.g. ``("dp", "cp")``:
        the ranks that share every other coordinate), as rank 0's group: ``flashpar.cost.group_hardware`` of its
        ranks, the function the runtime asks with a process group's ranks (``flashpar.links``)."""
        return _group(self, layout, tuple(dims))

    def describe(self) -> str:
        return (f"{self.gpus_per_node} GPUs/node, {self.device_name} in a node "
                f"({self.device.link_bytes_per_s / 1e9:.0f} GB/s per GPU each way), {self.inter_name} between nodes "
                f"({self.inter.link_bytes_per_s / 1e9:.0f} GB/s per GPU)")


@functools.lru_cache(maxsize=4096)
def _group(cluster: Cluster, dims: ParallelDims, names: tuple[str, ...]) -> tuple[int, Hardware, str]:
    ranks = dims.group_ranks(names)
    if len(ranks) == 1:
        return 1, cluster.device, "-"
    hw = group_hardware(cluster.device, cluster.inter, ranks, cluster.gpus_per_node)
    return len(ranks), hw, "ib" if hw.nodes > 1 else "nvlink"
