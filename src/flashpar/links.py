"""The figures a running job decides on: the device's, how its ranks share a host's cores, and each process
group's own link.

    device_hardware(type)        this device: a ``flashpar.cost.use`` block's figures, this machine's calibration
                                 file's, else the preset (``cpu`` -> ``cpu-calibrated``; a visible GPU by its name:
                                 ``flashpar.cost.gpu_preset``, ``cuda`` -> ``h100-ib`` for one not listed)
    inter_hardware(type)         what joins the nodes: on CUDA one 400 Gb/s port per GPU (``h100-ib``'s link); a
                                 CPU job's hosts, the device's own link
    ranks_per_node()             torchrun's ``LOCAL_WORLD_SIZE``, else the world size (1 without a process group)
    group_hardware_of(group, t)  ``flashpar.cost.group_hardware`` of the group's global ranks: NVLink where they sit
                                 on one node, the port across nodes (with the nodes it spans, for NCCL's model)
    core_burst(type, group)      how much faster a cp rank computes while the ranks sharing its cores wait
                                 (``flashpar.cp.CostModel.burst``; ``host_cores``: the cores this job computes on)
    planning_device(type, group) ``(device_hardware, core_burst)`` of rank 0 on every rank: what every rank's plans
                                 are made with (the trainer's, inference's prefill)

``mode="auto"`` (``flashpar.overlap.call.pick_mode``) picks on ``group_hardware_of`` of the op's group, and the
simulator times a layout's groups with the same ``flashpar.cost.group_hardware`` of the same ranks
(``flashpar.sim.topology.Cluster.group``): tp inside a node on NVLink, dp / cp across nodes on the port::

    2 nodes x 4 GPUs, dp 2 x tp 4      tp group [0, 1, 2, 3]  -> NVLink, nodes 1
                                       dp group [0, 4]        -> the port, nodes 2
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from flashpar.cost import PRESETS, Hardware, gpu_preset, group_hardware, preset, shared_burst
from flashpar.cost import store as cost_store
from flashpar.dist import from_rank0
from flashpar.ranks import local_world_size

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
    return local_world_size(dist.get_world_size())


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


def core_burst(device_type: str, group: int = 1) -> float:
    """``CostModel.burst`` of this process's job: how many times faster one cp rank (``group`` processes, tp x
    ulysses) computes while the ranks sharing its cores wait.  1 on a GPU (a device per rank) and wherever every
    thread has a core; on a CPU host running ``L`` processes (torchrun's ``LOCAL_WORLD_SIZE``, else the world
    size) of ``t`` threads (``torch.get_num_threads``) on ``C`` cores (``host_cores``: the CPU affinity, or a
    container's quota), ``flashpar.cost.shared_burst(L, t, C, group)``: ``L min(t, C) / C`` for ``group`` 1.
    1 when the job spans nodes: the cp group's ranks may then not share one host's cores."""
    if device_type != "cpu" or spans_nodes():
        return 1.0
    return shared_burst(ranks_per_node(), torch.get_num_threads(), host_cores(), group)


CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
"""cgroup v2's CPU quota of this process's group (``"max 100000"``, or ``"200000 100000"``: 2 cores' worth)."""


def host_cores(cpu_max: Path | None = None) -> int:
    """The cores this process's job computes on: its CPU affinity, or fewer where a cgroup v2 quota (``cpu.max``,
    ``CPU_MAX`` unless given; a container's ``--cpus``) allows less, rounded up.  A quota file that is absent,
    unlimited or unreadable leaves the affinity."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = (cpu_max or CPU_MAX).read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError, ZeroDivisionError):
        pass  # no cgroup v2 quota here: the affinity alone
    return cores


def planning_device(device_type: str, group: int = 1) -> tuple[Hardware, float]:
    """``(device_hardware, core_burst)`` of rank 0 on every rank (``group``: the processes of a cp rank, tp x
    ulysses): what every rank plans with (a collective call, once at setup: a calibration file, a thread count
    or a core count may differ between nodes, the plans of one step may not).  Only rank 0 reads them; where it
    cannot (a broken calibration file, a malformed ``LOCAL_WORLD_SIZE``) every rank raises its one-line
    ``ValueError``."""
    figures: tuple[Hardware, float] | str | None = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            figures = (device_hardware(device_type), core_burst(device_type, group))
        except ValueError as err:
            figures = str(err)
    figures = from_rank0(figures)
    if isinstance(figures, str):
        raise ValueError(f"planning figures of rank 0: {figures}")
    return figures
