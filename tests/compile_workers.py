"""Per-rank bodies of the compiled-model tests (run by dist_harness.run_ranks)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from flashpar.models.parallel import MESH_DIMS
from train_workers import MODELS, sequences


def compiled_against_float64(rank, world, cases):
    """For each ``(shape, dp_mode, model, settings)`` of ``cases``: ``one_step``'s relative errors against the float64
    single-process step, eager and compiled (``ParallelOptions.compile``), as two dicts (the loss and every
    gradient)."""
    from flashpar.train.check import one_step

    out = []
    for shape, dp_mode, model, settings in cases:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
        cfg = MODELS[model]
        seqs = sequences(shape[0], vocab=cfg.vocab_size)
        errs = [one_step(cfg, mesh, seqs, strategy="flashcp", mode="flash", dp_mode=dp_mode, compile=compile,
                         reference_dtype=torch.float64, **dict(settings)) for compile in (False, True)]
        out.append(tuple(errs))
    return out
