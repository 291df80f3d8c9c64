"""Prefill: a batch of prompts packed as the documents of one sequence, run forward-only through the parallel
model's own blocks (TP-SP linears with FlashOverlap, FlashCP attention with the plan's sharding-aware K/V
exchange), planned by the planner for a forward pass alone.

    tokens   = cat(prompts)                                   one document per prompt
    plan     = cp.plan(lens, cp, cost=forward-only cost)      which tokens each cp rank holds
    x_t      = embed(tokens of this cp rank), tp rank t's rows
    x_t      = block_l(x_t, plan)   for every layer           the training forward's own code; each block
                                                              hands its rotated K and V (this tp rank's kv
                                                              heads, every token of the cp rank) to the cache
    h_last   = gather_tp(x_t[last tokens of each prompt held by tp rank t])
    logits   = gather_tp_cols(norm(h_last) head_t^T)          [prompts here, V]
    out[p]   = sum over cp of each rank's rows                 (a prompt's last token is on one cp rank)

Nothing keeps autograd state (``torch.no_grad``).  Every rank returns every prompt's last-token logits (fp32).
"""

from __future__ import annotations

import torch

from flashpar.cp.cp_plan import CPPlan
from flashpar.cp.layout import to_device
from flashpar.dist import all_gather_blocks, all_gather_cat, p2p_group, resolve_group
from flashpar.infer.cache import RankCache
from flashpar.infer.comm import all_reduce
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
    for i, block in enumerate(model.blocks):
        block.kv_sink = cache.sink(i) if cache is not None else None
        try:
            x = block(x, tables, plan, split, [t_cp])
        finally:
            block.kv_sink = None
    return last_logits(model, x, plan, split)


def last_logits(model, x: torch.Tensor, plan: CPPlan, split: list[int]) -> torch.Tensor:
    """Every prompt's last-token logits ``[prompts, V]`` (fp32, the same on every rank) from the last layer's
    output ``x`` (this tp rank's rows ``split[tp_rank]`` of the cp rank's tokens)."""
    tp, group, dtype = model.tp, model.tp_group, model.compute_dtype
    start = sum(split[: model.tp_rank])
    # the last token of each prompt this cp rank holds (the prompts' lengths: the plan's documents)
    lens = torch.tensor(plan.doc_lens, dtype=torch.long)
    docs = plan.doc_ids(model.cp_rank)
    last = torch.nonzero(plan.position_ids(model.cp_rank) == lens[docs] - 1).flatten()
    # each tp rank's rows are a contiguous block of the cp rank's tokens: it sends only the last tokens it holds,
    # and rank order keeps them in local order (the order of ``last``)
    bounds = [sum(split[:r]) for r in range(tp + 1)]
    counts = [int(((last >= bounds[r]) & (last < bounds[r + 1])).sum()) for r in range(tp)]
    own = last[(last >= start) & (last < start + split[model.tp_rank])] - start
    h = x.index_select(0, to_device(own, x.device))
    if tp > 1:
        h = torch.cat(all_gather_blocks(h, counts, group))
    head = model.embed.weight if model.head is None else model.head.weight
    logits = all_gather_cat(model.norm(h).to(dtype) @ head.to(dtype).T, group, tp, dim=-1).float()
    out = torch.zeros(len(plan.doc_lens), model.cfg.vocab_size, dtype=torch.float32, device=x.device)
    out.index_copy_(0, to_device(docs[last], x.device), logits)
    return all_reduce(out, model.cp_group, plan.cp_size)
