"""One rank's model and one optimizer step, with no bookkeeping: the part of training tests call directly.

    build(config, mesh, device, o) -> (cfg, ParallelLlama run with options o, its shards of one seeded Llama or of
                                      the Hugging Face folder --init-from read by slices, AdamW)
    forward_backward(model, ...)   one micro-batch: loss share; backward; gradients summed over copies
    accumulate(model, micro, n)    M micro-batches' gradients added up, summed over copies once
    gradients(model, micro, n)     accumulate, then the global gradient norm and clipping
    optimizer_step(model, opt, ..) gradients, the step's learning rate, AdamW step, gradients cleared
    train_step(model, opt, ...)    one micro-batch, no clipping: ``optimizer_step`` of one sequence

Gradient accumulation.  A step's global batch is ``M`` packed sequences per dp rank (``M x dp`` in
all); ``count`` is the number of targets of all of them, so the ranks' loss shares of all micro-batches
add up to the mean next-token loss of the global batch and the accumulated gradient is its gradient::

    micro-batch      0            1                  M-1
    backward     | grads += | grads += |  ...  | grads += ; sums over copies posted (grad_sync) | finish
    ZeRO-3 rows  | RS_dp    | RS_dp    |  ...  | RS_dp      (inside every backward: sharded.py)

The sums over the ranks holding copies (``flashpar.models.grad_sync``) are armed for the last
micro-batch only: a post-accumulate hook fires after autograd has added that backward's gradient to
``.grad``, so it posts the sum of all M micro-batches, once.  ZeRO-3's reduce-scatter of the gradient
rows over dp runs inside every backward (each rank keeps only its rows, the whole-row gradient does
not outlive the op); the sum is linear, so ``RS(g_0) + ... + RS(g_{M-1}) = RS(g_0 + ... + g_{M-1})``
up to fp32 rounding, and its rows' sum over cp x ulysses is again posted once, on the last backward.

Every rank of the mesh calls each function together (they are collective), with the same ``M``.
Nothing here makes a host synchronisation: the loss and the gradient norm come back as tensors on the
model's device; reading them (``float(loss)``) is the caller's, after the step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashpar.links import planning_device
from flashpar.models import Llama
from flashpar.models.grad_norm import clip_grads_
from flashpar.models.parallel import ParallelLlama
from flashpar.options import ParallelOptions
from flashpar.train import where
from flashpar.train.config import TrainConfig
from flashpar.train.optimizer import adamw, set_lr
from flashpar.train.planning import resolve_options


class MicroBatch(NamedTuple):
    """This rank's part of one packed sequence: the cp rank's tokens and targets (``cp.shard(x, plan,
    cp_rank)``) and the sequence's plan."""

    tokens_cp: torch.Tensor
    labels_cp: torch.Tensor
    plan: object


def build(config: TrainConfig, mesh, device, options: ParallelOptions | None = None) -> tuple:
    """``(cfg, model, opt)``: the mesh model (run with ``options``: ``config``'s with the set-up choices made,
    ``flashpar.train.planning.resolve_options``; None: made here, a collective) holding this rank's shards of
    ``Llama(config.model)`` made after
    ``torch.manual_seed(config.seed)`` (every rank the same weights), and its AdamW (weight decay on the
    matrices only: ``flashpar.train.optimizer``).  With ``init_from`` each rank reads only its slices of that
    Hugging Face folder (no full model in any process), unless a ``resume`` checkpoint is about to
    overwrite them."""
    cfg = config.model
    full = None
    if not config.init_from:
        torch.manual_seed(config.seed)
        full = Llama(cfg)
    if options is None:
        options = resolve_options(config, device.type, planning_device(device.type, config.tp * config.ulysses))
    model = ParallelLlama(cfg, mesh, options)
    if full is not None:
        model.load_full(full)
    elif not config.resume:  # a Hugging Face folder's weights (a resumed checkpoint overwrites them)
        model.load_hf_slices(config.init_from)
    model.to(device)
    opt = adamw(model, lr=config.lr, weight_decay=config.weight_decay)
    return cfg, model, opt


def forward_backward(model: ParallelLlama, tokens_cp: torch.Tensor, labels_cp: torch.Tensor, plan,
                     count: float, *, sum_grads: bool = True, checked: bool = False,
                     leave_tail: bool = False) -> torch.Tensor:
    """This rank's share of the loss (``ParallelLlama.forward``: the cp rank's tokens / targets of ``plan``,
    ``count`` the global batch's targets), after backward, which adds its gradients to ``.grad``; with
    ``sum_grads`` (the last micro-batch) they are then summed over the ranks holding copies
    (``reduce_grads``, posted during backward).  ``checked``: the inputs were checked across ranks already
    (``ParallelLlama.check_step``).  ``leave_tail``: the last gradient sum stays in flight
    (``ParallelLlama.reduce_grads``), its ``GradTail`` kept in ``model.grad_tail`` for the norm."""
    where.enter("forward")
    loss = model(tokens_cp, plan, labels_cp, count, checked=checked)
    if sum_grads:
        model.sum_grads_in_backward()  # each gradient's sum travels while backward computes the earlier layers
    where.enter("backward")
    loss.backward()
    if sum_grads:
        where.enter("gradient sums")
        model.grad_tail = model.reduce_grads(leave_tail=leave_tail)
    return loss.detach()


def accumulate(model: ParallelLlama, micro_batches: list[MicroBatch], count: float, *,
               leave_tail: bool = False) -> torch.Tensor:
    """Forward and backward of each micro-batch in turn, their gradients added up in ``.grad`` and summed over
    copies once, after the last (see the module docstring).  Returns this rank's share of the global
    batch's loss (the micro-batches' shares added: a device tensor)."""
    if not micro_batches:
        raise ValueError("accumulate: no micro-batches")
    last = len(micro_batches) - 1
    where.enter("input check")
    model.check_step([(mb.tokens_cp, mb.labels_cp, mb.plan) for mb in micro_batches], count)  # one exchange a step
    losses = [forward_backward(model, *mb, count, sum_grads=m == last, checked=True, leave_tail=leave_tail)
              for m, mb in enumerate(micro_batches)]
    return losses[0] if len(losses) == 1 else torch.stack(losses).sum()


def gradients(model: ParallelLlama, micro_batches: list[MicroBatch], count: float, *,
              clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``accumulate``, then the global gradient norm over every shard and, with ``clip > 0``, the gradients
    scaled to at most that norm (``flashpar.models.grad_norm``: one all-reduce, no host wait).  The last
    gradient sum of backward (ZeRO-3's reduce-scatter of the embedding, whose gradient is complete only at
    the end) travels while the norm's squares of every other gradient are summed.  Returns
    ``(loss share, norm before clipping)``, both device tensors."""
    loss = accumulate(model, micro_batches, count, leave_tail=True)
    where.enter("gradient norm")
    tail, model.grad_tail = model.grad_tail, None
    return loss, clip_grads_(model, clip, tail=tail)


def optimizer_step(model: ParallelLlama, opt: torch.optim.Optimizer, micro_batches: list[MicroBatch], count: float,
                   *, clip: float = 0.0, lr: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on ``M = len(micro_batches)`` sequences of this dp rank: ``gradients``, the rate
    ``lr`` on every parameter group (``None``: as it is), ``opt.step()``, gradients cleared.  Returns
    ``(loss share, gradient norm before clipping)`` (device tensors; the shares summed over all ranks: the
    mean next-token loss of the global batch)."""
    loss, norm = gradients(model, micro_batches, count, clip=clip)
    if lr is not None:
        set_lr(opt, lr)
    where.enter("optimizer")
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, norm


def train_step(model: ParallelLlama, opt: torch.optim.Optimizer, tokens_cp: torch.Tensor, labels_cp: torch.Tensor,
               plan, count: float) -> torch.Tensor:
    """One optimizer step on one sequence per dp rank, no clipping and no norm (so no collective beyond the
    step's own): ``forward_backward``, ``opt.step()``, gradients cleared.  Returns this rank's share of the
    loss (summed over all ranks: the mean next-token loss of the global batch)."""
    loss = forward_backward(model, tokens_cp, labels_cp, plan, count)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss
