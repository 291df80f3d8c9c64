"""``flashpar train --check``: the mesh model against the single-process model after one step.

Every rank builds the same single-process ``Llama`` (one seed) and the same ``dp`` packed
sequences; the reference loss and gradients come from that model on all sequences, the loss
normalised by the global number of targets.  The mesh model takes its shards of the same
weights, its dp rank's sequence, its cp shard (the plan) and its ulysses and tp rows, and after one
``forward_backward`` (the step without the optimizer: ``flashpar.train.step``) its loss (summed
over ranks) and every gradient (tp shards gathered) are compared with the reference: relative
error ``max |a - b| / max |b|``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from flashpar import cp
from flashpar.models import Llama, LlamaConfig, load_hf, next_token_loss
from flashpar.models.layout import LAYOUT, label_of
from flashpar.models.parallel import ParallelLlama
from flashpar.train.step import forward_backward

TOL = 1e-4  # fp32: the mesh only reorders sums (~1e-6 relative); one misplaced shard is O(1)


def one_step(cfg: LlamaConfig, mesh, sequences, *, strategy: str, mode: str, seed: int = 0,
             timeout_s: float = 300.0, dp_mode: str = "zero3", init_from: str | None = None) -> dict[str, float]:
    """Relative errors of the loss and of every parameter's gradient (names of the single-process model).
    ``init_from``: the weights of that Hugging Face folder (the reference ``load_hf``, the mesh model its
    slices: ``ParallelLlama.load_hf_slices``) instead of seeded ones."""
    torch.manual_seed(seed)
    ref = load_hf(init_from, dtype=torch.float32) if init_from else Llama(cfg)
    count = sum(int((lab != -100).sum()) for _, lab, _ in sequences)
    ref_loss = sum(next_token_loss(ref(tok, lens), lab, count) for tok, lab, lens in sequences)
    ref_loss.backward()
    model = ParallelLlama(cfg, mesh, mode=mode, timeout_s=timeout_s, dp_mode=dp_mode)
    if init_from:
        model.load_hf_slices(init_from)
    else:
        model.load_full(ref)
    d, c = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    tokens, labels, doc_lens = sequences[d]
    plan = cp.plan(doc_lens, mesh["cp"].size(), strategy=strategy)
    total = forward_backward(model, cp.shard(tokens, plan, c), cp.shard(labels, plan, c), plan, count).clone()
    dist.all_reduce(total)
    ref_value = float(ref_loss.detach())
    errors = {"loss": abs(float(total) - ref_value) / abs(ref_value)}
    grads = dict(ref.named_parameters())
    for name, g in model.full_grads().items():
        want = grads[name].grad
        errors[name] = float((g - want).abs().max() / want.abs().max().clamp_min(1e-12))
    return errors


def by_group(errors: dict[str, float]) -> list[tuple[str, float, bool]]:
    """``(group, worst relative error, passed)`` per parameter group, the loss first; the groups are the
    rows of ``flashpar.models.layout.LAYOUT``, in its order.  A NaN error is the worst and fails."""
    found: dict[str, list[float]] = {}
    for name, err in errors.items():
        if name != "loss":
            found.setdefault(label_of(name), []).append(err)
    rows = [("loss", [errors["loss"]])] + [(lay.label, found[lay.label]) for lay in LAYOUT.values()
                                            if lay.label in found]
    return [(label, _worst(errs), all(e <= TOL for e in errs)) for label, errs in rows]


def _worst(errs: list[float]) -> float:
    return next((e for e in errs if math.isnan(e)), max(errs))
