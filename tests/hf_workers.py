"""Per-rank bodies of tests/test_hf.py (run by dist_harness.run_ranks; no ``transformers`` here: the folders
were written by the pytest process)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh

from flashpar.models import LlamaConfig, load_hf
from flashpar.models.parallel import MESH_DIMS, ParallelLlama
from flashpar.train import checkpoint
from flashpar.train.check import TOL, one_step
from flashpar.train.config import TrainConfig
from train_workers import sequences


def slices_on_meshes(rank, world, folder, cases, checkpoint_dir=None):
    """Per ``(shape, dp_mode)`` of ``cases``: the bytes this rank read from the folder by slices and the bytes
    of its parameters; whether its parameters, gathered (``to_full``), equal ``load_hf`` exactly; the errors
    of ``one_step(init_from=folder)`` over ``TOL`` and their count.  With ``checkpoint_dir`` the first case's
    model (as loaded, before any step) is also saved there as a training checkpoint (for export)."""
    cfg = LlamaConfig.from_hf(folder)
    ref = dict(load_hf(folder, dtype=torch.float32).named_parameters())
    out = []
    for i, (shape, dp_mode) in enumerate(cases):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
        model = ParallelLlama(cfg, mesh, dp_mode=dp_mode)
        read = model.load_hf_slices(folder)
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        full = model.to_full({n: p.detach() for n, p in model.named_parameters()})
        exact = sorted(full) == sorted(ref) and all(torch.equal(full[n], ref[n]) for n in ref)
        if checkpoint_dir is not None and i == 0:
            config = TrainConfig(nproc=world, dp=shape[0], cp=shape[1], ulysses=shape[2], tp=shape[3], model=cfg,
                                 seq_len=64)
            opt = torch.optim.AdamW(model.parameters())
            path = Path(checkpoint_dir) / "step_0"
            path.mkdir(parents=True, exist_ok=True)
            checkpoint.save(path, model, opt, 0, config)
        errors = one_step(cfg, mesh, sequences(shape[0]), strategy="flashcp", mode="flash", dp_mode=dp_mode,
                          init_from=folder)
        out.append((read, held, exact, {k: v for k, v in errors.items() if not v <= TOL}, len(errors)))
    return out
