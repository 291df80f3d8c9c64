"""Per-rank bodies of the parallel-model tests (run by dist_harness.run_ranks)."""

from __future__ import annotations

import dataclasses
import random

import torch
from torch.distributed.device_mesh import init_device_mesh

from flashpar.models import LlamaConfig
from flashpar.train.check import TOL, one_step

CFG = LlamaConfig(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64)


def sequences(dp: int, seed: int = 0):
    """``dp`` packed sequences: (tokens, labels, doc_lens); labels are the next token of the same document."""
    rng = random.Random(seed)
    out = []
    for _ in range(dp):
        doc_lens = [rng.choice([1, 3, 8, 17, 30]) for _ in range(7)]
        total = sum(doc_lens)
        tokens = torch.tensor([rng.randrange(256) for _ in range(total)])
        labels = torch.roll(tokens, -1)
        ends = torch.tensor(doc_lens).cumsum(0) - 1
        labels[ends] = -100
        out.append((tokens, labels, doc_lens))
    return out


def check_mesh(rank, world, shape, dp_mode="zero3", tie=True, strategy="flashcp", mode="flash"):
    dp, cpn, tp = shape
    mesh = init_device_mesh("cpu", (dp, cpn, tp), mesh_dim_names=("dp", "cp", "tp"))
    cfg = CFG if tie else dataclasses.replace(CFG, tie_embeddings=False)
    errors = one_step(cfg, mesh, sequences(dp), strategy=strategy, mode=mode, dp_mode=dp_mode)
    return {k: v for k, v in errors.items() if not v <= TOL}, len(errors)
