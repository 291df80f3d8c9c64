"""What the trainer's plans are made with: the model's shape on the device it trains on, one cost model on
every rank.

    planner_cost(cfg, ..)       the planner's cost model: the model's shape on the training device, per step
    group_figures(hw, ..)       the device's figures for one of the mesh's groups (its link: NVLink, or the port
                                across nodes)
    resolve_options(config, ..) the run's ParallelOptions with ZeRO-3's auto choices made on rank 0's figures

The device's figures and how much faster a rank computes while the ranks sharing its cores wait, rank 0's on
every rank, are ``flashpar.links.planning_device`` (``device_hardware``, ``core_burst``).  Ranks that share cores
(``core_burst`` > 1; ``flashpar.cp.CostModel.burst``) are a CPU host running more threads than it has cores, as
``flashpar bench train`` does (4 ranks of 1 thread on 2 cores): a rank that waits hands its core to the others,
so the step follows the ranks' total work, and a plan that balances them by cutting a document costs a K/V
exchange and buys nothing::

    4 ranks, 2 cores, cp 2 x tp 2        whole documents                   the long one cut
    cp rank 0 (2 tp ranks)     |======= shared =======|== alone ==|      |====== shared ======|kv|=|
    cp rank 1 (2 tp ranks)     |======= shared =======|                  |====== shared ======|kv|=|
                                        step = total work / cores         the same work, plus waits on K/V
"""

from __future__ import annotations

from flashpar import links
from flashpar.cost import Hardware, group_hardware
from flashpar.cp import CostModel
from flashpar.cp.cost import cost_model_of
from flashpar.dims import ParallelDims
from flashpar.models import LlamaConfig
from flashpar.options import ParallelOptions
from flashpar.options import of as options_of


def planner_cost(cfg: LlamaConfig, dtype_bytes: int = 4, device_type: str = "cpu",
                 hardware: Hardware | None = None, burst: float | None = None, group: int = 1) -> CostModel:
    """The cost model the trainer's plans are made with: this model's shape, activations of ``dtype_bytes``
    (fp32: 4, ``--dtype bf16``: 2), on the device it trains on, weighted for a training step
    (``CostModel.per_step``).

    The device's figures are ``hardware`` and ``burst`` when given (the trainer passes rank 0's, so that every
    rank plans alike), else ``flashpar.links.device_hardware(device_type)`` and ``core_burst(device_type, group)``
    (``group``: the processes of one cp rank, tp x ulysses).  The device decides the plans: on a GPU preset a
    small model's step is so short that splitting a long document costs more in K/V than it balances, and the
    planner keeps documents whole; on this CPU with a core per rank, that plan's slowest rank takes 1.15x as
    long as with the long document split; with 2 ranks per core (``bench train``) the step takes the ranks'
    total work whatever the split, and the planner keeps the document whole again (``bench train``'s pack,
    ``tests/test_planner_device.py``, ``tests/test_shared_cores.py``)."""
    hw = hardware if hardware is not None else links.device_hardware(device_type)
    burst = burst if burst is not None else links.core_burst(device_type, group)
    return cost_model_of(cfg, dtype_bytes, hw, burst).per_step()


def group_figures(hw: Hardware, dims: ParallelDims, group: tuple[str, ...], device_type: str) -> Hardware:
    """``hw`` (rank 0's device figures) for rank 0's group over mesh dims ``group``: ``flashpar.cost.group_hardware``
    of its ranks, with ``flashpar.links.inter_hardware``'s link where they span nodes (``ranks_per_node``) -- the
    function the simulator's ``Cluster.group`` and the runtime's ``mode="auto"`` ask."""
    per_node = links.ranks_per_node() if links.spans_nodes() else dims.world_size
    return group_hardware(hw, links.inter_hardware(device_type), dims.group_ranks(group), per_node)


def resolve_options(config, device_type: str, figures: tuple[Hardware, float]) -> ParallelOptions:
    """``config``'s ``ParallelOptions`` with the set-up choices made: ZeRO-3's schedule per block and how its units
    travel, each as given (``--zero-schedule``, ``--zero-collective``; an ``auto`` collective in mode none: ``ring``;
    replicated weights: ``prefetch`` / ``ring``, unused), or for ``auto`` the cost model's choice on
    ``zero_workload`` with ``figures`` (rank 0's device figures and core burst, ``planning_device``: read once by the
    caller for this and the planner).  Schedules: ``flashpar.sim.zero.zero_schedule`` (the whole step simulated with
    every block prefetched, block 0 fused and the rest prefetched, and every block fused; the fastest where it beats
    every block prefetched by more than ``ZERO_AUTO_MARGIN``); the collective: ``flashpar.sim.zero.zero_collective``."""
    from flashpar.sim.zero import zero_collective, zero_schedule

    options = options_of(config)
    if options.dp_mode != "zero3":
        return options.replace(zero_schedule="prefetch", zero_collective="ring")
    schedules = options.zero_schedule
    collective = options.zero_collective
    if collective == "auto" and options.mode == "none":
        collective = "ring"
    if schedules == "auto" or collective == "auto":
        w, peer = zero_workload(config, device_type, figures)
        if schedules == "auto":
            schedules = tuple(zero_schedule(w, peer))
        if collective == "auto":
            collective = zero_collective(w, peer)
    return options.replace(zero_schedule=schedules, zero_collective=collective)


def zero_workload(config, device_type: str, figures: tuple[Hardware, float]):
    """``(Workload, Peer)`` the trainer's ZeRO-3 choice is simulated on: rank 0's planning figures ``figures``, the
    run's mesh, model and ``ParallelOptions`` (``Workload.of``), one sequence of ``--seq-len`` tokens of one document
    (the trainer chooses before it has read any data), the configuration of its ``--mode``; so every rank chooses the
    same."""
    import dataclasses

    from flashpar.sim.peers import PEERS
    from flashpar.sim.topology import Cluster, Layout
    from flashpar.sim.workload import Workload

    hw, burst = figures
    layout = Layout(config.dp, config.cp, config.ulysses, config.tp)
    per_node = links.ranks_per_node() if links.spans_nodes() else layout.world_size
    cluster = Cluster(hw, links.inter_hardware(device_type), per_node)
    w = Workload.of(config.model, layout, cluster, ((config.seq_len,),), options_of(config), plan_burst=burst,
                    shared_cores=burst)
    peer = dataclasses.replace(PEERS["flashpar" if config.mode != "none" else "baseline"], mode=config.mode)
    return w, peer
