"""Prefill: a batch of prompts packed as the documents of one sequence, run forward-only through the parallel
model's own blocks (TP-SP linears with FlashOverlap, FlashCP attention with the plan's sharding-aware K/V
exchange), planned by the planner for a forward pass alone.

    tokens   = cat(prompts)                                   one document per prompt
    plan     = cp.plan(lens, cp, cost=forward-only cost)      which tokens each cp rank holds
    x_t      = embed(tokens of this cp rank), tp rank t's rows
    x_t      = block_l(x_t, plan)   for every layer but the   the training forward's own code; each block
                                    last                      hands its rotated K and V (this tp rank's kv
                                                              heads, every token of the cp rank) to the cache
    last layer:  q, k, v of every token (K and V to the cache), then only what the first token reads:
    o_last   = attention of the last tokens' queries          (cp.attention's rows; the plan's K/V exchange)
    h_last   = gather_tp(x_t[last tokens of each prompt held by tp rank t])       [prompts here, h]
    h_last  += o_proj and MLP of those rows                   (flashpar.infer.replicated: all-reduces over tp)
    logits   = gather_tp_cols(norm(h_last) head_t^T)          [prompts here, V]
    out[p]   = sum over cp of each rank's rows                 (a prompt's last token is on one cp rank)

Every other token's output of the last layer feeds nothing the first token reads (it would be the next layer's
input, and there is none): the last layer computes its queries' attention, ``o_proj`` and MLP for the prompts'
last tokens only, exactly what the whole layer gives them.  Of the layer's GEMMs only the q/k/v projection
(every token's K and V are cached) runs on every token, and of its sequence-parallel transfers only the
all-gather before it.

Nothing keeps autograd state (``torch.no_grad``).  Every rank returns every prompt's last-token logits (fp32).
"""

from __future__ import annotations

import torch

from flashpar.cp.cp_plan import CPPlan
from flashpar.cp.layout import to_device
from flashpar.dist import all_gather_blocks, p2p_group, resolve_group
from flashpar.infer.cache import RankCache
from flashpar.infer.comm import all_reduce
from flashpar.infer.replicated import block_tail, head_logits
from flashpar.models.fused import rope_tables
from flashpar.rows import row_sizes


@torch.no_grad()
def prefill(model, tokens_cp: torch.Tensor, plan: CPPlan, cache: RankCache | None) -> torch.Tensor:
    """Every prompt's last-token logits ``[prompts, V]`` (fp32, the same on every rank) of the packed prompts,
    this cp rank's tokens ``tokens_cp`` (``cp.shard(tokens, plan, cp_rank)``); the K/V of every layer into
    ``cache`` (None: not kept).  ``model``: a ``ParallelLlama`` without ZeRO-3 and with ulysses 1 (checked by
    the caller)."""
    cfg, tp, group = model.cfg, model.tp, model.tp_group
    # every rank creates its tp group's and its cp group's point-to-point twin now, in this order: a rank that
    # holds no tokens of the batch (fewer tokens than ranks) sends nothing on tp and would skip creating the
    # tp twin there, leaving the ranks' counts of groups, by which torch names new groups, apart (a hang)
    for g in (group, model.cp_group):
        p2p_group(resolve_group(g), 0, 1, op_name="flashpar.infer.prefill", timeout_s=model.step_check.timeout_s)
    t_cp = tokens_cp.shape[0]
    split = row_sizes(t_cp, tp)
    start = sum(split[: model.tp_rank])
    rows = slice(start, start + split[model.tp_rank])
    dtype = model.compute_dtype
    positions = to_device(plan.position_ids(model.cp_rank), tokens_cp.device)
    tables = rope_tables(positions, cfg, dtype)
    x = model.embed_tokens(tokens_cp, rows, model.embed.weight)[0]
    last = last_tokens(plan, model.cp_rank)
    *blocks, final = model.blocks
    for i, block in enumerate(blocks):
        block.kv_sink = cache.sink(i) if cache is not None else None
        try:
            x = block(x, tables, plan, split, [t_cp])
        finally:
            block.kv_sink = None
    # the last layer: K and V of every token (the cache's), everything after them of the last tokens only
    final.kv_sink = cache.sink(len(blocks)) if cache is not None else None
    try:
        o = final.attend(x, tables, plan, split, [t_cp], rows=tuple(last.tolist()))
    finally:
        final.kv_sink = None
    h = last_rows(model, x, split, last)
    h = block_tail(final, h, o.index_select(0, to_device(last, o.device)), group, tp, dtype)
    return last_logits(model, h, plan, last)


def last_tokens(plan: CPPlan, cp_rank: int) -> torch.Tensor:
    """The local rows (the plan's local order, ascending) of the prompts' last tokens cp rank ``cp_rank`` holds
    (the prompts' lengths: the plan's documents); host tensor."""
    lens = torch.tensor(plan.doc_lens, dtype=torch.long)
    return torch.nonzero(plan.position_ids(cp_rank) == lens[plan.doc_ids(cp_rank)] - 1).flatten()


def last_rows(model, x: torch.Tensor, split: list[int], last: torch.Tensor) -> torch.Tensor:
    """The rows ``last`` (local rows of the cp rank, ascending) of ``x``, whose tp rank ``t`` holds the rows
    ``split[t]`` (a contiguous block of the cp rank's tokens), on every tp rank: ``[len(last), h]``."""
    tp, t = model.tp, model.tp_rank
    start = sum(split[:t])
    # each tp rank sends only the rows it holds; rank order keeps them in local order (the order of ``last``)
    bounds = [sum(split[:r]) for r in range(tp + 1)]
    counts = [int(((last >= bounds[r]) & (last < bounds[r + 1])).sum()) for r in range(tp)]
    own = last[(last >= start) & (last < start + split[t])] - start
    h = x.index_select(0, to_device(own, x.device))
    return torch.cat(all_gather_blocks(h, counts, model.tp_group)) if tp > 1 else h


def last_logits(model, h: torch.Tensor, plan: CPPlan, last: torch.Tensor) -> torch.Tensor:
    """Every prompt's last-token logits ``[prompts, V]`` (fp32, the same on every rank) from the last layer's
    output ``h`` at this cp rank's last tokens (rows ``last``, the same on every tp rank): the head, each prompt
    in its row, summed over cp (a prompt's last token is on one cp rank)."""
    logits = head_logits(model, h)
    out = torch.zeros(len(plan.doc_lens), model.cfg.vocab_size, dtype=torch.float32, device=h.device)
    docs = plan.doc_ids(model.cp_rank)[last]
    out.index_copy_(0, to_device(docs, h.device), logits)
    return all_reduce(out, model.cp_group, plan.cp_size)
