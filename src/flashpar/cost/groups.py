"""The figures of one group of ranks: the device's, with the link the group's transfers ride.

Node ``k`` holds ranks ``[k G, (k + 1) G)`` (``G`` devices per node, torchrun's ``LOCAL_WORLD_SIZE``).  A group
whose ranks all sit on one node rides the device's own link (NVLink); a group spanning ``N > 1`` nodes rides
the network port of each rank (``inter``'s link figures), with ``nodes = N`` and the NVLink rate kept as
``node_link_bytes_per_s`` for the collectives' model (``Hardware.collective``)::

    G = 8, 16 ranks         node 0: ranks 0-7          node 1: ranks 8-15
    group [0, 1, 2, 3]      one node   -> the device's link                      (tp 4)
    group [0, 4, 8, 12]     two nodes  -> the port's link, nodes 2, ppn 2        (cp 4 at stride 4)

The simulator (``flashpar.sim.topology.Cluster.group``) and the runtime (``flashpar.links``: the process group's
own ranks) both ask :func:`group_hardware`, so ``mode="auto"`` picks on the link the simulator times.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from flashpar.cost.hardware import Hardware


def nodes_spanned(ranks: Iterable[int], per_node: int) -> int:
    """How many nodes of ``per_node`` ranks the global ``ranks`` sit on."""
    if per_node < 1:
        raise ValueError(f"devices per node must be >= 1, got {per_node}")
    return len({r // per_node for r in ranks}) or 1


def group_hardware(device: Hardware, inter: Hardware, ranks: Iterable[int], per_node: int) -> Hardware:
    """``device``'s figures for the group of global ``ranks`` (the module docstring): its own link on one node,
    ``inter``'s link across nodes."""
    nodes = nodes_spanned(ranks, per_node)
    if nodes == 1:
        return replace(device, nodes=1, node_link_bytes_per_s=0.0)
    return replace(device, link_bytes_per_s=inter.link_bytes_per_s, link_latency_s=inter.link_latency_s,
                   nodes=nodes, node_link_bytes_per_s=device.node_link_bytes_per_s or device.link_bytes_per_s)
