"""Vocabulary-parallel embedding and cross-entropy over the tp group, with sequence parallelism.

Tp rank ``t`` holds the vocabulary rows ``[lo, hi) = [t Vp / tp, (t + 1) Vp / tp)`` of the embedding
(and of the head, or the same rows when tied), ``Vp`` the vocabulary ``V`` padded to a multiple of tp
(``flashpar.models.layout.VocabRows``: the rows past ``V`` are zeros, no token looks them up, and their
logits are ``-inf``, ``masked_padding``, so they add nothing to the loss and get no gradient).  The cp
rank's tokens are all present on every tp rank; each tp rank keeps the hidden states of its block of rows
(``shard_rows``).

    embedding:  x_t = reduce_scatter_rows( E_t[tok - lo] if lo <= tok < hi else 0 )     [rows_t, h]
    logits:     z   = all_gather_matmul(norm(x_t), E_t)                                  [T, V / tp]
    loss row i: log sum_t sum_v exp(z_iv - m_i) + m_i - z_i[target_i]        (m_i: max over all v)

The row maximum and the two sums are all-reduced over tp.  The maximum only shifts the exponent
(the loss does not depend on it), so it is reduced without autograd; the sums go through
``all_reduce_sum``, whose gradient is the all-reduce of the gradients: every tp rank's loss
terms use the same reduced sum ``y = sum_t x_t``, so ``dL/dx_t = sum_t' dL_t'/dy``.  Rank ``t``
adds the losses of its block of rows only, so the loss summed over the ranks counts every target
once.

A small vocabulary against many tokens (``gathers_weight``: ``V < T``, as a byte-level model on a long
sequence): moving the activations costs each rank ``(tp - 1) / tp x T x h`` elements per use (the
embedding's reduce-scatter, the head's all-gather, and their adjoints in backward), moving the weight
``(tp - 1) / tp x V x h``.  Then the weight is gathered instead, once per forward for each weight (tied: one
gather feeds both), and each rank computes its own rows whole, with no loss all-reduce::

    E  = all_gather_rows(E_t)                                   [V, h]      (flashpar.models.zero; backward: RS, fp32)
    x_t = E[tok_t]                                              [rows_t, h]
    z_t = norm(x_t) E_head^T                                    [rows_t, V]
    loss row i: log sum_v exp(z_iv - m_i) + m_i - z_i[target_i]             (m_i: this row's maximum)

    in flight (tp 2, rank t):   tp: | E_t -> t+1, E_{t+1} <- t+1 |          (one transfer of V/2 x h, fp32)
                                main: waits, then every row of its block with the whole vocabulary

The gather moves the fp32 weight (its gradient is summed across ranks in fp32, as every gradient is,
``flashpar.models.precision``); it is cast to the compute dtype after.  The same values as the
activation path: each embedding row has one nonzero term there, and each loss row sums the same
exponentials (in another order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flashpar.models.llama import IGNORE
from flashpar.models.precision import widened
from flashpar.models.regions import EAGER, Regions
from flashpar.models.zero import reduce_scatter_rows


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """``sum_t x_t`` over the group on every rank; backward: the gradients summed over the group."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)


def gathers_weight(vocab: int, tokens: int, tp: int) -> bool:
    """Whether the tp ranks gather the vocabulary weight (``[V / tp, h]`` a rank) rather than move the
    activations of the ``tokens`` (``[tokens / tp, h]`` a rank): where the weight is the smaller, ``V < T``.
    ``tokens`` is the same on every tp rank of a cp (and ulysses) rank, so they all take the same path."""
    return tp > 1 and vocab < tokens


def embed_rows(tokens: torch.Tensor, weight: torch.Tensor, lo: int, group, *,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """This tp rank's rows of the embedding of ``tokens [T]`` from the vocabulary rows ``weight`` (from ``lo``),
    in ``dtype`` (default the weight's).  The rows are looked up in the weight's dtype and cast before the
    reduce-scatter (mixed precision: it moves bf16; each sum has one nonzero term, so it is exact)."""
    inside = (tokens >= lo) & (tokens < lo + weight.shape[0])
    partial = F.embedding((tokens - lo).clamp(0, weight.shape[0] - 1), weight) * inside.unsqueeze(-1)
    return reduce_scatter_rows(partial.to(dtype or weight.dtype), group)


def vocab_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, lo: int, group, rows: slice,
                        count: float, vocab: int | None = None, regions: Regions = EAGER) -> torch.Tensor:
    """Summed next-token cross-entropy of ``rows`` (targets ``labels [T]``, -100: none) from this tp rank's
    vocabulary columns ``logits [T, V / tp]`` (from ``lo``), divided by ``count``.  ``vocab``: the columns from
    ``vocab`` on are padding (``masked_padding``).  ``regions``: whose ``loss_sums`` (``flashpar.models.regions``;
    the compiled one with ``--compile``)."""
    logits = masked_padding(widened(logits), lo, vocab)
    top = logits.detach().max(-1).values
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    valid = labels != IGNORE
    mine = valid & (labels >= lo) & (labels < lo + logits.shape[1])
    index = (labels - lo).clamp(0, logits.shape[1] - 1)  # rank-dependent values as tensors: one graph on every rank
    total, picked = regions.loss_sums(logits, top, index, mine)
    total, picked = all_reduce_sum(total, group), all_reduce_sum(picked, group)
    per_row = (torch.log(total) + top - picked) * valid
    return per_row[rows].sum() / max(count, 1.0)


def masked_padding(logits: torch.Tensor, lo: int, vocab: int | None) -> torch.Tensor:
    """``logits [..., C]`` (global columns ``lo .. lo + C``) with ``-inf`` at the padded columns ``>= vocab``
    (``flashpar.models.layout.VocabRows``): their exponentials are zero, in the loss and in sampling, and so is
    their gradient.  Unchanged where nothing is padded."""
    if vocab is None or lo + logits.shape[-1] <= vocab:
        return logits
    pad = torch.arange(lo, lo + logits.shape[-1], device=logits.device) >= vocab
    return logits.masked_fill(pad, float("-inf"))


def own_rows_loss(x_rows: torch.Tensor, head: torch.Tensor, labels_rows: torch.Tensor, count: float,
                  vocab: int | None = None, regions: Regions = EAGER) -> torch.Tensor:
    """Summed next-token cross-entropy of this rank's rows from their hidden states ``x_rows [rows, h]`` and
    the whole head ``head [V, h]`` (both in the compute dtype; ``labels_rows``: -100 none), divided by
    ``count``: ``vocab_parallel_loss`` on a group of one (every column is this rank's, nothing is reduced)."""
    return vocab_parallel_loss(x_rows @ head.t(), labels_rows, 0, None, slice(None), count, vocab, regions)
