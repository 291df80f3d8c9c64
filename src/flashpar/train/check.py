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
from flashpar.models import Llama, LlamaConfig, next_token_loss
from flashpar.models.layout import LAYOUT, label_of
from flashpar.models.parallel import ParallelLlama
from flashpar.models.precision import DTYPES
from flashpar.train.step import forward_backward

TOL = 1e-4  # fp32: the mesh only reorders sums (~1e-6 relative); one misplaced shard is O(1)


def one_step(cfg: LlamaConfig, mesh, sequences, *, strategy: str, mode: str, seed: int = 0,
             timeout_s: float = 300.0, dp_mode: str = "zero3", dtype: str = "fp32",
             checkpoint_activations: bool = False) -> dict[str, float]:
    """Relative errors of the loss and of every parameter's gradient (names of the single-process model).
    ``dtype`` / ``checkpoint_activations``: the mesh model's (``--dtype``, ``--checkpoint-activations``); the
    reference stays the fp32 single-process model."""
    torch.manual_seed(seed)
    ref = Llama(cfg)
    count = sum(int((lab != -100).sum()) for _, lab, _ in sequences)
    ref_loss = sum(next_token_loss(ref(tok, lens), lab, count) for tok, lab, lens in sequences)
    ref_loss.backward()
    model = ParallelLlama(cfg, mesh, mode=mode, timeout_s=timeout_s, dp_mode=dp_mode, dtype=DTYPES[dtype],
                          checkpoint_activations=checkpoint_activations)
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


def by_group(errors: dict[str, float], tol: float = TOL) -> list[tuple[str, float, bool]]:
    """``(group, worst relative error, passed)`` per parameter group, the loss first; the groups are the
    rows of ``flashpar.models.layout.LAYOUT``, in its order.  A NaN error is the worst and fails.  ``tol``:
    the bound (``flashpar.models.precision.CHECK_TOL`` of the run's dtype)."""
    found: dict[str, list[float]] = {}
    for name, err in errors.items():
        if name != "loss":
            found.setdefault(label_of(name), []).append(err)
    rows = [("loss", [errors["loss"]])] + [(lay.label, found[lay.label]) for lay in LAYOUT.values()
                                            if lay.label in found]
    return [(label, _worst(errs), all(e <= tol for e in errs)) for label, errs in rows]


def _worst(errs: list[float]) -> float:
    return next((e for e in errs if math.isnan(e)), max(errs))
