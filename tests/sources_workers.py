"""Per-rank bodies of tests/test_train_sources.py (run by dist_harness; no transformers import here)."""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.device_mesh import init_device_mesh

from flashpar.models.parallel import MESH_DIMS


def eval_loss_on_meshes(rank, world, config, shapes):
    """``{shape: (HeldOut loss of the seeded mesh model, float64 single-process loss of the same sequences)}``."""
    from flashpar.models import Llama, next_token_loss
    from flashpar.train.data import training_data
    from flashpar.train.evaluate import held_out
    from flashpar.train.planning import planner_cost
    from flashpar.train.step import build

    out = {}
    for shape in shapes:
        dp, cpn, ulysses, tp = shape
        cfg = dataclasses.replace(config, nproc=world, dp=dp, cp=cpn, ulysses=ulysses, tp=tp)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
        _, model, _ = build(cfg, mesh, torch.device("cpu"))
        evaluator = held_out(cfg, planner_cost(cfg.model), mesh, torch.device("cpu"))
        got = evaluator.loss(model)
        # the reference: the same seeded weights in float64, every used held-out sequence, one divisor
        held = training_data(cfg, "eval")
        items = [held[i] for i in range(evaluator.sequences)]
        count = sum(int((it["labels"] != -100).sum()) for it in items)
        torch.manual_seed(cfg.seed)
        ref = Llama(cfg.model).double()
        with torch.no_grad():
            want = float(sum(next_token_loss(ref(it["tokens"], it["doc_lens"]), it["labels"], count) for it in items))
        out[shape] = (got, want, evaluator.sequences, count == evaluator.count)
    return out


def train_a_few_steps(rank, world, config):
    """``flashpar.train.loop.train`` on this world (rank 0: the summary)."""
    from flashpar.train.loop import train

    return train(config)


def sources_cases(rank, world, eval_config, shapes, train_configs):
    return {"eval": eval_loss_on_meshes(rank, world, eval_config, shapes),
            "train": [train_a_few_steps(rank, world, config) for config in train_configs]}
