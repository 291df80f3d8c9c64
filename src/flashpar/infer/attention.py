"""Decode attention: one query per prompt over the cached keys this rank holds, and the exact combine of the
partial results of a prompt split over several ranks.

Over the keys ``K_r`` a rank ``r`` holds of a prompt (scale ``s = D^-1/2``; grouped-query: query head ``h``
reads kv head ``h // (H / H_kv)``)::

    lse_r = log sum_{j in K_r} exp(s q.k_j)                   (-inf where the rank holds none)
    o_r   = sum_{j in K_r} exp(s q.k_j - lse_r) v_j

and over the group of ranks that hold the prompt, exactly the attention over all its keys::

    LSE = log sum_r exp(lse_r),     o = sum_r exp(lse_r - LSE) o_r

(the softmax's denominator is the sum of the parts' denominators, each part's weights rescaled to it).  The
group's partials travel in one all-gather per layer, ``[ranks, split prompts, heads, D + 1]``: ``o_r`` with
``lse_r`` as its last column; a rank outside a prompt's group sends ``lse = -inf`` for it, which weighs 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [R, H, D], lse [R, H])`` of queries ``q [R, H, D]`` over keys ``k, v [R, L, H_kv, D]`` where
    ``valid [R, L]``, in at least fp32 (a row without a valid key: ``o = 0``, ``lse = -inf``)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[2]
    kf = k.to(acc).repeat_interleave(group, dim=2)  # [R, L, H, D]
    vf = v.to(acc).repeat_interleave(group, dim=2)
    scores = torch.einsum("rhd,rlhd->rhl", q.to(acc), kf) * scale
    scores = scores.masked_fill(~valid[:, None, :], -torch.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [R, H]; -inf where no key is valid
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # (-inf) - (-inf) = nan: no keys, weight 0
    return torch.einsum("rhl,rlhd->rhd", weights, vf), lse


def combine(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact attention of partials ``o [N, ..., D]`` with ``lse [N, ...]`` over their first dim (the
    log-sum-exp rule of the module docstring); ``(o, LSE)``."""
    top = lse.max(dim=0).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # every part empty: weights all 0
    w = torch.exp(lse - top)  # [N, ...]
    total = w.sum(dim=0)
    out = (w[..., None] * o).sum(dim=0) / total.clamp_min(torch.finfo(total.dtype).tiny)[..., None]
    return out, top + torch.log(total)


def combine_split(o: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, n_split: int, group,
                  cp_size: int) -> torch.Tensor:
    """``o`` with its rows ``rows`` (those of split prompts; ``slots``: each one's index among the ``n_split`` split
    prompts, both built once per batch) replaced by the combine over the cp ``group`` (one all-gather); the other
    rows unchanged.  Every cp rank calls it at every layer when ``n_split > 0`` (the all-gather is collective).
    Index tensors only: nothing is read back to the host."""
    heads, d = o.shape[1], o.shape[2]
    part = torch.zeros(n_split, heads, d + 1, dtype=o.dtype, device=o.device)
    part[..., d] = -torch.inf
    part.index_copy_(0, slots, torch.cat([o, lse[..., None]], dim=-1).index_select(0, rows))
    parts = [torch.empty_like(part) for _ in range(cp_size)]
    dist.all_gather(parts, part, group=group)
    stacked = torch.stack(parts)  # [N, S, H, D + 1]
    full, _ = combine(stacked[..., :d], stacked[..., d])
    return o.index_copy(0, rows, full.index_select(0, slots))
