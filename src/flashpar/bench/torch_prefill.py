"""The ``torch`` peer of ``flashpar bench prefill``: ``bench train``'s peer (``flashpar.bench.torch_parallel``:
DTensor TP-SP, K/V all-gathered over cp, SDPA per (document, chunk)) run forward-only on one packed batch of
prompts, to every prompt's first token.

    batch   = make_batch(prompts)                 the per-document head-tail shard and its attention
                                                  layout, built once with the runner (outside the timing)
    h       = model.hidden(tokens, positions)     [1, S_loc, hidden], Shard(1) over tp
    logits  = first_logits(h)                     [prompts, V] on every rank: the head (ColwiseParallel,
                                                  vocabulary columns) gathered over tp, the rows of the
                                                  prompts' last tokens this cp rank holds, summed over cp
    token   = argmax(logits)

It has no KV cache, so it does not decode.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from flashpar.bench import torch_parallel
from flashpar.bench.torch_llama import TorchLlama


class TorchPrefill:
    """The peer on ``mesh`` (``("dp", "cp", "tp")``, dp 1) with ``full``'s weights, for the prompts ``ids``."""

    def __init__(self, full, mesh, ids: list[list[int]]) -> None:
        model = TorchLlama(full.cfg)
        model.load_full(full)
        if mesh["tp"].size() > 1:
            torch_parallel.apply_tp(model, mesh["tp"])
        if mesh["cp"].size() > 1:
            for block in model.blocks:
                block.attn.cp_group = mesh["cp"].get_group()
        self.model, self.mesh, self.ids = model, mesh, ids
        tokens = torch.tensor(sum(ids, []))
        lens = [len(p) for p in ids]
        self.batch = torch_parallel.make_batch(tokens, tokens, lens, mesh, torch.device("cpu"))
        # this rank's original positions (the layout's), and which of them ends a prompt: (prompt, local row)
        ends = torch.tensor(lens).cumsum(0) - 1
        mine = self.batch.layout.mine
        self.last = [(p, int(i)) for p, end in enumerate(ends.tolist()) for i in torch.nonzero(mine == end).flatten()]

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
        logits = first_logits(self.model, h, self.last, len(self.ids), self.mesh)
        return logits, logits.argmax(-1)


def first_logits(model: TorchLlama, h, last: list[tuple[int, int]], prompts: int, mesh) -> torch.Tensor:
    """Every prompt's last-token logits ``[prompts, V]`` (the same on every rank) from the last block's output
    ``h``: the head over this cp rank's tokens, gathered over tp, its rows ``last`` ((prompt, local row) pairs),
    summed over cp (a prompt's last token is on one cp rank)."""
    from torch.distributed.tensor import DTensor

    logits = model.head(model.norm(h))
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    first = torch.zeros(prompts, model.cfg.vocab_size)
    for p, i in last:
        first[p] = logits[0, i]
    if mesh["cp"].size() > 1:
        dist.all_reduce(first, group=mesh["cp"].get_group())
    return first
