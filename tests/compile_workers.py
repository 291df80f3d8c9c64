"""Per-rank bodies of the compiled-model tests (``tests/test_compile.py``, run by dist_harness)."""

from __future__ import annotations

import dataclasses
import random

import torch
from torch.distributed.device_mesh import init_device_mesh

from flashpar.models.parallel import MESH_DIMS
from train_workers import CFG, MODELS, sequences

# Qwen3 with its attention biases: every optional input of the regions given (qk-norm gains, q/k/v and o biases)
COMPILE_MODELS = {**MODELS, "biased": dataclasses.replace(CFG, family="qwen3", qk_norm=True, qkv_bias=True,
                                                          o_bias=True, tie_embeddings=False)}


def compiled_against_float64(rank, world, cases):
    """For each ``(shape, dp_mode, model, settings)`` of ``cases``: ``one_step``'s relative errors (the loss and every
    gradient) against the float64 single-process step, eager and compiled (``ParallelOptions.compile``)."""
    from flashpar.train.check import one_step

    out = []
    for shape, dp_mode, model, settings in cases:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
        cfg = COMPILE_MODELS[model]
        seqs = sequences(shape[0], vocab=cfg.vocab_size)
        out.append(tuple(one_step(cfg, mesh, seqs, strategy="flashcp", mode="flash", dp_mode=dp_mode, compile=c,
                                  reference_dtype=torch.float64, **dict(settings)) for c in (False, True)))
    return out


def graphs_of_warm_up(rank, world, models):
    """For each model name: the graphs ``warm_up`` compiles for it on a mesh of one rank (training, then prefill's
    forward-only regions), and the graph breaks ``torch._dynamo.explain`` finds in each region."""
    from flashpar.models import regions
    from flashpar.models.compiling import warm_up
    from flashpar.models.parallel import ParallelLlama

    mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=MESH_DIMS)
    out = {}
    for name in models:
        model = ParallelLlama(COMPILE_MODELS[name], mesh, compile=True)
        out[name] = (warm_up(model).graphs, warm_up(model, grad=False).graphs, warm_up(model).graphs)
    x, w = torch.randn(7, 32), torch.ones(32)
    explained = torch._dynamo.explain(regions.add_norm)(x, x, None, w, 1e-5)
    out["explain"] = (explained.graph_count, explained.graph_break_count)
    return out


def steady_steps(rank, world, shape, steps):
    """``steps`` forward-backward passes of a compiled model on ``shape``, each on its own packed sequence (so its
    own CP plan and token counts), after ``warm_up``: ``(graphs of the warm-up, graphs compiled during the
    steps)``."""
    from flashpar import cp
    from flashpar.models.compiling import warm_up
    from flashpar.models.parallel import ParallelLlama

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
    model = ParallelLlama(CFG, mesh, compile=True)
    report = warm_up(model)
    rng = random.Random(1)
    c = mesh["cp"].get_local_rank()
    for _ in range(steps):
        lens = [rng.randrange(2, 40) for _ in range(rng.randrange(2, 6))]
        tokens = torch.randint(0, CFG.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(len(lens)))
        labels = torch.roll(tokens, -1)
        plan = cp.plan(lens, mesh["cp"].size(), strategy="flashcp")
        loss = model(cp.shard(tokens, plan, c), plan, cp.shard(labels, plan, c), float(sum(lens)))
        loss.backward()
    return report.graphs, report.recompiles()
