"""The ``torch`` peer of ``flashpar bench prefill``: ``bench train``'s peer (``flashpar.bench.torch_parallel``:
DTensor TP-SP, K/V all-gathered over cp, SDPA per (document, chunk)) run forward-only on one packed batch of
prompts, to every prompt's first token.

    batch   = make_batch(prompts)                 the per-document head-tail shard and its attention
                                                  layout (SDPA per (document, chunk): square chunks
                                                  is_causal, the others with their additive lower-right
                                                  mask), built once with the runner (outside the timing)
    h       = model.hidden(tokens, positions)     [1, S_loc, hidden], Shard(1) over tp
    logits  = first_logits(h)                     [prompts, V] on every rank: the final norm, the rows of the
                                                  prompts' last tokens this rank holds, the head on those
                                                  rows (ColwiseParallel: gathered over tp, vocabulary
                                                  columns, gathered whole), summed over cp
    token   = argmax(logits)

It has no KV cache, so it does not decode.  With ``compile_blocks`` (``bench prefill``'s ``torch_compile``) every
block is ``torch.compile``d after TP as ``bench train``'s compiled peer (``flashpar.bench.compiled_blocks``:
``fullgraph=True``, inductor); it runs under ``no_grad``, so the graphs are forward-only.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from flashpar.bench import torch_parallel
from flashpar.bench.torch_llama import TorchLlama


class TorchPrefill:
    """The peer on ``mesh`` (``("dp", "cp", "tp")``, dp 1) with ``full``'s weights, for the prompts ``ids``; with
    ``compile_blocks`` its blocks compiled (:func:`flashpar.bench.compiled_blocks.compile_blocks`)."""

    def __init__(self, full, mesh, ids: list[list[int]], compile_blocks: bool = False) -> None:
        model = TorchLlama(full.cfg)
        model.load_full(full)
        if mesh["tp"].size() > 1:
            torch_parallel.apply_tp(model, mesh["tp"])
        if mesh["cp"].size() > 1:
            for block in model.blocks:
                block.attn.cp_group = mesh["cp"].get_group()
        if compile_blocks:
            from flashpar.bench.compiled_blocks import compile_blocks as compile_each

            compile_each(model, mesh["tp"].size())
        self.model, self.mesh, self.ids = model, mesh, ids
        tokens = torch.tensor(sum(ids, []))
        lens = [len(p) for p in ids]
        self.batch = torch_parallel.make_batch(tokens, tokens, lens, mesh, torch.device("cpu"))
        # each non-square chunk's lower-right mask as the additive mask SDPA turns a boolean one into on every call
        # (0 where a key is seen, -inf elsewhere), made once here in the activations' dtype
        dtype = model.norm.weight.dtype
        for chunk in self.batch.layout.chunks:
            if chunk.mask is not None:
                chunk.mask = torch.zeros(chunk.mask.shape, dtype=dtype).masked_fill_(~chunk.mask, -torch.inf)
        # the prompts' last tokens among this rank's positions (the layout's), by the tp rank whose sequence shard
        # holds them (SequenceParallel: tp rank t the t-th contiguous S_loc / tp rows), and where each lands in the
        # head's gathered rows: tp rank t's picks at [t m, t m + count_t), m the most any tp rank picks
        ends = torch.tensor(lens).cumsum(0) - 1
        mine = self.batch.layout.mine
        tp, t = mesh["tp"].size(), mesh["tp"].get_local_rank()
        shard = mine.numel() // tp
        picks = [[] for _ in range(tp)]  # per tp rank: (row in its shard, prompt)
        for p, end in enumerate(ends.tolist()):
            for i in torch.nonzero(mine == end).flatten().tolist():
                picks[i // shard].append((i % shard, p))
        m = max(1, max(len(x) for x in picks))
        self.pick = torch.tensor([i for i, _ in picks[t]] + [0] * (m - len(picks[t])), dtype=torch.long)
        self.slots = torch.tensor([r * m + j for r in range(tp) for j in range(len(picks[r]))], dtype=torch.long)
        self.prompts = torch.tensor([p for r in range(tp) for _, p in picks[r]], dtype=torch.long)

    def kv_bytes(self) -> int:
        """The K/V a rank all-gathers per layer, times the layers: what a cache of it would hold."""
        cfg, tp = self.model.cfg, self.mesh["tp"].size()
        return 2 * cfg.layers * (cfg.kv_heads // tp) * cfg.head_dim * 4 * sum(len(p) for p in self.ids)

    def run(self) -> tuple[float, torch.Tensor, torch.Tensor]:
        """``(time to first token s, first logits [prompts, V], first tokens [prompts])``."""
        t0 = time.perf_counter()
        logits, tokens = self.first_token()
        return time.perf_counter() - t0, logits, tokens

    @torch.no_grad()
    def first_token(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batch
        h = self.model.hidden(b.tokens, b.positions, b.layout)
        return first_logits(self.model, h, self.pick, self.slots, self.prompts, len(self.ids), self.mesh)


def first_logits(model: TorchLlama, h, pick: torch.Tensor, slots: torch.Tensor, prompts: torch.Tensor, n: int,
                 mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """Every prompt's last-token logits ``[n, V]`` (the same on every rank) and its first token, from the last
    block's output ``h``: the final norm on this rank's sequence shard, its last tokens' rows ``pick`` (padded to
    the same count on every tp rank), the head (its ColwiseParallel plan: those rows all-gathered over tp, its
    vocabulary columns, gathered whole), the rows ``slots`` of the gathered rows in the rows of their ``prompts``,
    summed over cp (a prompt's last token is on one cp rank): the logits of the last tokens only, as
    transformers' ``logits_to_keep``."""
    from torch.distributed.tensor import DTensor

    x = model.norm(h)
    local = x.to_local() if isinstance(x, DTensor) else x
    logits = model.head(local[:, pick])  # with tp: the plan's input hook takes the local rows as a Shard(1) part
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    first = torch.zeros(n, model.cfg.vocab_size, dtype=logits.dtype)
    first.index_copy_(0, prompts, logits[0].index_select(0, slots))
    if mesh["cp"].size() > 1:
        dist.all_reduce(first, group=mesh["cp"].get_group())
    return first, first.argmax(-1)
