"""Per-rank bodies of tests/test_auto_links.py (run by dist_harness.run_ranks)."""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from flashpar.models.parallel import MESH_DIMS
from flashpar.overlap import call
from train_workers import CFG, sequences


def recorded_picks(rank, world, shape):
    """One training step of the (dp, cp, ulysses, tp) mesh ``shape`` in mode auto, with every ``pick_mode`` call
    of a group of more than one rank recorded: (sim op, group size, rows, n_in, n_out, merged, regather, split,
    the group's global ranks)."""
    from flashpar.train.check import one_step

    seen = []
    real = call.pick_mode

    def spy(mode, chunks, n, sim_op, rows, n_in, n_out, x, **kw):
        if mode == "auto" and n > 1:
            group = kw.get("group")
            members = dist.get_process_group_ranks(group) if group is not None else list(range(world))
            seen.append((sim_op, n, rows, n_in, n_out, kw.get("merged"), kw.get("regather"), kw.get("split"),
                         tuple(members)))
        return real(mode, chunks, n, sim_op, rows, n_in, n_out, x, **kw)

    call.pick_mode = spy
    try:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
        one_step(CFG, mesh, sequences(shape[0]), strategy="flashcp", mode="auto")
    finally:
        call.pick_mode = real
    return sorted(set(seen))


def group_links(rank, world, local):
    """``flashpar.links.group_hardware_of`` of this rank's tp and dp groups on a (dp 2, tp 2) mesh with torchrun's
    ``LOCAL_WORLD_SIZE`` = ``local``: (nodes spanned, link bytes/s) of each."""
    from flashpar.links import group_hardware_of

    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    mesh = init_device_mesh("cpu", (2, 1, 1, 2), mesh_dim_names=MESH_DIMS)
    return {d: (group_hardware_of(mesh[d].get_group(), "cpu").nodes, dist.get_process_group_ranks(mesh[d].get_group()))
            for d in ("tp", "dp")}


def sharded_pick_rows(rank, world, shape):
    """One step of the (dp, cp, ulysses, tp) mesh ``shape``, mode auto, every block fused ZeRO-3: the rows each
    ``pick_mode`` call of the shard group's side (sim op ``sharded``) was given, and this rank's own tokens."""
    from flashpar.train.check import one_step

    rows, real = [], call.pick_mode

    def spy(mode, chunks, n, sim_op, r, n_in, n_out, x, **kw):
        if sim_op == "sharded":
            rows.append(r)
        return real(mode, chunks, n, sim_op, r, n_in, n_out, x, **kw)

    call.pick_mode = spy
    try:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
        one_step(CFG, mesh, sequences(shape[0]), strategy="flashcp", mode="auto", zero_schedule="fused")
    finally:
        call.pick_mode = real
    return sorted(set(rows))
