"""Per-rank bodies of the parallel-model tests (run by dist_harness.run_ranks)."""

from __future__ import annotations

import random

import torch
from torch.distributed.device_mesh import init_device_mesh

from flashpar import cp
from flashpar.models import Llama, LlamaConfig, next_token_loss
from flashpar.models.parallel import ParallelLlama

CFG = LlamaConfig(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64)
# fp32: the loss and each gradient entry are sums over <= 2 x 120 tokens through two blocks; the
# parallel model only reorders sums (sequence blocks, K/V pieces, ranks), ~1e-6 relative; 1e-4 is
# the bound and still catches one misplaced shard (O(1)).
TOL = 1e-4


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


def reference(dp: int):
    torch.manual_seed(0)
    model = Llama(CFG)
    seqs = sequences(dp)
    count = sum(int((lab != -100).sum()) for _, lab, _ in seqs)
    loss = sum(next_token_loss(model(tok, lens), lab, count) for tok, lab, lens in seqs)
    loss.backward()
    return model, float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def check_mesh(rank, world, shape, strategy="flashcp", mode="flash"):
    dp, cpn, tp = shape
    mesh = init_device_mesh("cpu", (dp, cpn, tp), mesh_dim_names=("dp", "cp", "tp"))
    ref_model, ref_loss, ref_grads = reference(dp)
    model = ParallelLlama(CFG, mesh, mode=mode)
    model.load_full(ref_model)
    d, c = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    seqs = sequences(dp)
    count = sum(int((lab != -100).sum()) for _, lab, _ in seqs)
    tokens, labels, doc_lens = seqs[d]
    plan = cp.plan(doc_lens, cpn, strategy=strategy)
    logits, rows = model(cp.shard(tokens, plan, c), plan)
    loss = next_token_loss(logits, cp.shard(labels, plan, c)[rows], count)
    loss.backward()
    model.reduce_grads()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    errors = {"loss": abs(float(total) - ref_loss) / abs(ref_loss)}
    for name, g in model.full_grads().items():
        errors[name] = float((g - ref_grads[name]).abs().max() / ref_grads[name].abs().max().clamp_min(1e-12))
    return {k: v for k, v in errors.items() if not v <= TOL}, len(errors)
