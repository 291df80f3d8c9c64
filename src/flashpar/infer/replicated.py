"""A block's part after attention, and the head, on rows every rank of a tp group holds whole: decode's rows (one
per prompt) and prefill's last tokens (the only rows the first token reads, from the last layer's attention on).
Tensor parallel over heads and FFN columns, Megatron's without sequence parallelism (a few rows: too few to
split); tp rank ``t`` holds its heads' columns of ``w_o``, its FFN rows of ``w_gu`` and columns of ``w_down``,
its vocabulary rows of the head::

    x       += sum_t o_t w_o[:, t]^T + b_o                          one all-reduce over tp
    x       += sum_t swiglu(norm(x) w_gu[t]^T + b_gu[t]) w_down[:, t]^T + b_down      one all-reduce over tp
    logits   = gather_t(norm(x) head_t^T)[:, :V]                    [R, V], fp32 (the vocabulary's padding cut)

The biases are the family's (``flashpar.models.families``; none for Llama): the output ones added once, after
the sum.

Each sum has one term per tp rank, added in the all-reduce: every rank of the group gets the same ``x``.
"""

from __future__ import annotations

import torch

from flashpar.dist import all_gather_cat
from flashpar.infer.comm import all_reduce
from flashpar.models.fused import swiglu


def block_tail(block, x: torch.Tensor, o: torch.Tensor, group, tp: int, dtype: torch.dtype) -> torch.Tensor:
    """``x [R, h]`` after ``block``'s ``o_proj`` and MLP, from its attention output ``o [R, heads_t D]`` (this tp
    rank's heads)."""
    out = all_reduce(o @ block.o_proj.weight.to(dtype).T, group, tp)
    x = x + (block.o_bias(out) if block.o_bias is not None else out)
    gu = block.mlp_norm(x).to(dtype) @ block.gate_up.weight.to(dtype).T
    if block.gate_up_bias is not None:
        gu = block.gate_up_bias(gu)
    out = all_reduce(swiglu(gu) @ block.down.weight.to(dtype).T, group, tp)
    return x + (block.down_bias(out) if block.down_bias is not None else out)


def head_logits(model, x: torch.Tensor) -> torch.Tensor:
    """The logits ``[R, V]`` (fp32) of the last block's output ``x [R, h]``, the same on every tp rank."""
    dtype = model.compute_dtype
    head = model.embed.weight if model.head is None else model.head.weight
    logits = all_gather_cat(model.norm(x).to(dtype) @ head.to(dtype).T, model.tp_group, model.tp, dim=-1)
    return logits[:, : model.cfg.vocab_size].float()
