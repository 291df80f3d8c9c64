"""Every process group flashpar makes: the device mesh of the parallel dims, the flattened groups the model needs,
gloo's point-to-point twins and the host group of a check.  ``torch.distributed.new_group`` and
``init_device_mesh`` are called here and nowhere else.

Creating a group is collective: every rank of the world makes every group, in the same order, or the job hangs.
So each function below makes its groups in one fixed order, and the model makes all of its own in one call
(``model_groups``), right after its mesh::

    mesh (dp, cp, ulysses, tp)             device_mesh: the sub-meshes' groups (tp, cp, ulysses, dp)
    model_groups(mesh, zero, fused):
        gather, scatter [, fused]          ZeRO-3's lanes: the shard group (dp x cp x ulysses ranks of one tp
                                           index) once per lane, so no lane's collectives interleave with another's
        shard                              the ranks a tp shard's gradient is summed over (dp x cp x ulysses)
        copy                               the whole mesh (replicated parameters' gradients)
    init_world(backend, timeout)           the default group, from the launcher's environment (under torchrun:
                                           a store of this restart's own)
    host_group(ranks)                      a gloo group for host integers (the step check on an NCCL mesh)
    twin_group(ranks)                      gloo's second connection between two ranks (flashpar.dist.p2p_group)

Each group is made for every tp index (or its one set of members); a rank keeps the one it belongs to.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


def init_world(backend: str, timeout: datetime.timedelta) -> None:
    """The default process group of ``backend`` from the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` /
    ``MASTER_PORT``: flashpar's launcher's or torchrun's).

    Under torchrun's agent (``TORCHELASTIC_USE_AGENT_STORE``) every restart of the workers meets the same store:
    the agent keeps it, while torch's ``env://`` rendezvous assumes a new one per restart and prefixes nothing.
    Restarted workers would then read the dead workers' addresses, which gloo's (and NCCL's) connection set-up
    finds refused.  So the default group's keys go under this restart's own prefix (``TORCHELASTIC_RESTART_COUNT``)::

        store (the agent's, one for the job):  flashpar/attempt_0/...  (the first workers, dead)
                                               flashpar/attempt_1/...  (the restarted ones: their own addresses)
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"flashpar/attempt_{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout)


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """The ``DeviceMesh`` of ``shape`` with dims ``names`` (every rank calls it; the process group is up)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def mesh_ranks(mesh) -> torch.Tensor:
    """The mesh's global ranks as ``[dp, cp, ulysses, tp]`` (a mesh without ``"ulysses"``: U = 1)."""
    ranks = mesh.mesh
    if "ulysses" not in (mesh.mesh_dim_names or ()):
        ranks = ranks.unsqueeze(2)
    return ranks


@dataclass(frozen=True)
class ModelGroups:
    """This rank's groups of a ``ParallelLlama`` beyond its mesh's (the module docstring); ``None`` where the group
    would be this rank alone (``shard``, ``copy``) or is not needed (the ZeRO-3 lanes)."""

    gather: dist.ProcessGroup | None = None
    scatter: dist.ProcessGroup | None = None
    fused: dist.ProcessGroup | None = None
    shard: dist.ProcessGroup | None = None
    copy: dist.ProcessGroup | None = None


def model_groups(mesh, *, zero: bool, fused: bool) -> ModelGroups:
    """Every group a ``ParallelLlama`` on ``mesh`` needs, made in one fixed order (collective: every rank calls it
    with the same ``zero`` (ZeRO-3 over a shard group of more than one rank) and ``fused`` (some block runs the
    fused schedule))."""
    ranks = mesh_ranks(mesh)
    dp, cpn, un, tp = ranks.shape
    me = dist.get_rank()
    out: dict[str, dist.ProcessGroup] = {}

    def make(key: str, member_lists: list[list[int]]) -> None:
        for members in member_lists:
            g = dist.new_group(members)
            if me in members:
                out[key] = g

    shards = [ranks[..., t].flatten().tolist() for t in range(tp)]
    if zero:
        for key in ("gather", "scatter", *(("fused",) if fused else ())):
            make(key, shards)
    if dp * cpn * un > 1:
        make("shard", shards)
    if dp * cpn * un * tp > 1:
        make("copy", [ranks.flatten().tolist()])
    return ModelGroups(**out)


def host_group(ranks: list[int]):
    """A gloo group of the global ``ranks`` for cross-rank checks of host integers (``None``: the default
    group, where that is gloo over exactly these ranks).  On an NCCL mesh such a check then never waits
    for the device: its integers stay on the host.  Collective where it creates a group: every rank of
    the world calls it, in the same order (``new_group``)."""
    ranks = sorted(ranks)
    if dist.get_backend() == "gloo" and ranks == list(range(dist.get_world_size())):
        return None
    return dist.new_group(ranks, backend="gloo")


def twin_group(ranks: list[int], timeout_s: float):
    """A second group of the global ``ranks`` (gloo: its own TCP connections), made by its members only
    (``use_local_synchronization``: the first time they all run a point-to-point schedule)."""
    return dist.new_group(ranks, timeout=datetime.timedelta(seconds=float(timeout_s)), use_local_synchronization=True)
