"""The figures a running job decides on: the device's, and each process group's own link.

    device_hardware(type)        this device: a ``flashpar.cost.use`` block's figures, this machine's calibration
                                 file's, else the preset (``cpu`` -> ``cpu-calibrated``; a visible GPU by its name:
                                 ``flashpar.cost.gpu_preset``, ``cuda`` -> ``h100-ib`` for one not listed)
    inter_hardware(type)         what joins the nodes: on CUDA one 400 Gb/s port per GPU (``h100-ib``'s link); a
                                 CPU job's hosts, the device's own link
    ranks_per_node()             torchrun's ``LOCAL_WORLD_SIZE``, else the world size (1 without a process group)
    group_hardware_of(group, t)  ``flashpar.cost.group_hardware`` of the group's global ranks: NVLink where they sit
                                 on one node, the port across nodes (with the nodes it spans, for NCCL's model)

``mode="auto"`` (``flashpar.overlap.call.pick_mode``) picks on ``group_hardware_of`` of the op's group, and the
simulator times a layout's groups with the same ``flashpar.cost.group_hardware`` of the same ranks
(``flashpar.sim.topology.Cluster.group``): tp inside a node on NVLink, dp / cp across nodes on the port::

    2 nodes x 4 GPUs, dp 2 x tp 4      tp group [0, 1, 2, 3]  -> NVLink, nodes 1
                                       dp group [0, 4]        -> the port, nodes 2
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from flashpar.cost import PRESETS, Hardware, gpu_preset, group_hardware, preset
from flashpar.cost import store as cost_store

INTER_PRESET = {"cuda": "h100-ib"}
"""The preset whose link joins the nodes, per device type (one 400 Gb/s NDR port per GPU, as in a DGX H100);
a device type not listed: its own link."""


def device_hardware(device_type: str) -> Hardware:
    """This process's device figures (the module docstring's order: a ``use`` block, the calibration file, the
    preset; on a visible GPU with no calibration, the GPU's own preset by its name)."""
    hw = cost_store.load(device_type)
    if device_type != "cuda" or not torch.cuda.is_available() or hw != preset(cost_store.device_preset("cuda")):
        return hw  # not a GPU, or figures from a use block or a calibration file
    return PRESETS[gpu_preset(torch.cuda.get_device_name())]


def inter_hardware(device_type: str) -> Hardware:
    """The figures of the link between nodes for ``device_type`` (``INTER_PRESET``, else the device's own)."""
    name = INTER_PRESET.get(device_type)
    return preset(name) if name is not None else device_hardware(device_type)


def ranks_per_node() -> int:
    """This node's ranks: torchrun's ``LOCAL_WORLD_SIZE``, else the world size (1 without a process group)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    try:
        n = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={os.environ['LOCAL_WORLD_SIZE']!r} is not an integer") from None
    if n < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={n} must be >= 1")
    return n


def spans_nodes() -> bool:
    """Whether this job's ranks are on more than one node (``ranks_per_node`` < world size)."""
    if not dist.is_available() or not dist.is_initialized():
        return False
    return ranks_per_node() < dist.get_world_size()


def group_hardware_of(group: dist.ProcessGroup | None, device_type: str) -> Hardware:
    """The figures of ``group`` (``None``: the world) for ``device_type``: ``flashpar.cost.group_hardware`` of its
    global ranks on nodes of ``ranks_per_node``."""
    device, inter = device_hardware(device_type), inter_hardware(device_type)
    if group is None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return group_hardware(device, inter, range(world), ranks_per_node())
    return group_hardware(device, inter, _ranks(group), ranks_per_node())


@functools.lru_cache(maxsize=256)
def _ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    """The global ranks of ``group`` (remembered per group: a group's members never change)."""
    return tuple(dist.get_process_group_ranks(group))
