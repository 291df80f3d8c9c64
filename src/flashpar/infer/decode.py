"""One decode step: the next token of every prompt this cp rank holds, tensor parallel over heads.

A cp rank decodes the prompts it holds K/V of (``RankCache.rows``): a Whole-Doc prompt on its one rank, a
split prompt on every rank of its group, each computing the same rows of the linears.  The tp ranks of a cp
rank hold the same rows and split the heads and FFN columns (Megatron's tensor parallelism without sequence
parallelism: a step has one row per prompt, too few to split)::

    x        = sum_tp embed_t(tok)                                   [R, h]      (vocabulary rows of rank t)
    q, k, v  = rope(qk_norm(norm(x) w_qkv[t]^T + b_qkv[t]))          [R, H/tp, D], [R, H_kv/tp, D]
    cache   <- k, v   (kept by the row's appending rank of this step)
    o, lse   = partial attention over the row's cached keys here     (flashpar.infer.attention; a layer's
                                                                      sliding window: its latest keys only)
    o        = combine over the prompt's group (split prompts: one all-gather over cp per layer)
    x       += sum_tp o w_o[:, t]^T                                  one all-reduce over tp
    x       += sum_tp swiglu(norm(x) w_gu[t]^T) w_down[:, t]^T       one all-reduce over tp
    logits   = gather_tp(norm(x) head_t^T)[:, :V]                    [R, V]   (the padded vocabulary cut)
                                                     (the last three: flashpar.infer.replicated)

The all-reduces are blocking: at a decode step's few rows a GEMM is far too short to hide a transfer behind,
so the overlapped decompositions could only add launches (``mode`` ``auto`` picks ``none`` there).  A step
reads nothing back to the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashpar.infer.attention import combine_split, partial_attention
from flashpar.infer.cache import RankCache
from flashpar.infer.comm import all_reduce
from flashpar.infer.replicated import block_tail, head_logits
from flashpar.models.fused import rope_tables
from flashpar.models.regions import EAGER


@torch.no_grad()
def decode_step(model, cache: RankCache, tokens: torch.Tensor, positions: torch.Tensor, step: int) -> torch.Tensor:
    """Logits ``[rows, V]`` (fp32) of the next token of every row of ``cache`` from its current token ``tokens
    [rows]`` at ``positions [rows]``; the tokens' K/V appended (decode step ``step`` of the schedule)."""
    cfg, tp, group, dtype = model.cfg, model.tp, model.tp_group, model.compute_dtype
    n_split, cp_size = len(cache.split_prompts), model.cp_group.size() if model.cp_group is not None else 1
    w = model.embed.weight
    inside = (tokens >= model.vocab_lo) & (tokens < model.vocab_lo + w.shape[0])
    x = (F.embedding((tokens - model.vocab_lo).clamp(0, w.shape[0] - 1), w) * inside[:, None]).to(dtype)
    x = all_reduce(x, group, tp)  # one nonzero term per row: exact
    tables = rope_tables(positions, cfg, dtype)
    valid = cache.valid(step)
    seen = {w: cache.in_window(valid, positions, w) for w in {b.window for b in model.blocks}}  # per window, once
    scale = cfg.head_dim ** -0.5
    for i, block in enumerate(model.blocks):
        a = block.attn_norm(x).to(dtype)
        # bias, q/k norm, rope; eager: a decode step's rows are one per sequence, its elementwise work negligible,
        # and a compiled region would compile again for one row (a size torch specialises)
        q, k, v = block.heads_of(a @ block.qkv.weight.to(dtype).T, tables, EAGER)
        cache.write(i, step, k, v)
        keys, values = cache.keys(i)
        o, lse = partial_attention(q, keys, values, seen[block.window], scale)
        if n_split:
            o = combine_split(o, lse, cache.split_rows, cache.split_slots, n_split, model.cp_group, cp_size)
        o = o.to(dtype).reshape(x.shape[0], block.heads * cfg.head_dim)  # (a rank may hold no rows)
        x = block_tail(block, x, o, group, tp, dtype)
    cache.advance(step)
    return head_logits(model, x)
