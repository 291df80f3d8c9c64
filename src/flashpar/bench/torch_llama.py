"""The ``torch`` peer of ``flashpar bench train``: flashpar's Llama written with plain torch layers.

The same decoder as :class:`flashpar.models.Llama` (RMSNorm, grouped-query attention with rotary
embeddings inside each document, SwiGLU, an untied or tied head), laid out as torchtitan's Llama
(an ``attn`` and an ``mlp`` submodule per block) so that torch's tensor-parallel plans apply to it
(:mod:`flashpar.bench.torch_parallel`).  Parameter names map one to one onto the single-process
model's (:func:`full_name`: ``blocks.3.attn.q_proj.weight`` <-> ``blocks.3.q_proj.weight``), so
``load_full`` copies the same initial weights.

One packed sequence per data-parallel rank, batch-first as torchtitan's model:

    cos, sin = rope tables of positions [S_loc]                          once per step
    h       = embed(tokens [1, S_loc])                                   [1, S_loc, hidden]
    h      += o_proj(attend(rope(q), gather_cp(rope(k)), gather_cp(v), layout))   per block
    h      += down(silu(gate(norm(h))) * up(norm(h)))
    logits  = head(norm(h))                                              [1, S_loc, vocab]
                                                    (``hidden``: h, before the final norm)

``S_loc`` is this context-parallel rank's tokens (all of them without cp), ``positions [S_loc]`` their
positions inside their documents and ``layout`` (:class:`flashpar.bench.torch_attention.DocLayout`, built
once per batch) which of the cp group's keys, in the order ``gather_cp`` concatenates them, each query
may see and how the kernel visits them.  ``gather_cp`` is the identity without cp and torch's
autograd-aware functional all-gather over the cp group with it.  The head count is read from the
projection's output (``view(.., -1, head_dim)``), so the block runs on a tensor-parallel rank's heads
unchanged.  The rope tables are computed once per step, as torchtitan's precomputed ``freqs_cis``, in
float64 and cast to the activations' dtype (``flashpar.models.rope.rotary_tables``, the model's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashpar.bench.torch_attention import DocLayout, attend
from flashpar.models.config import LlamaConfig
from flashpar.models.rope import inverse_frequencies, rotary_tables


def rope_tables(positions: torch.Tensor, cfg: LlamaConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin) [S, D]`` of the half-split rotation at ``positions [S]`` (each half's table repeated)."""
    cos, sin = rotary_tables(positions, inverse_frequencies(cfg, positions.device), dtype)
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x cos + rotate_half(x) sin`` over the last dim of ``x [..., S, D]``."""
    d = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., d:], x[..., :d]], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, d = cfg.hidden, cfg.head_dim
        self.head_dim, self.cfg = d, cfg
        self.q_proj = nn.Linear(h, cfg.heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.heads * d, h, bias=False)
        self.cp_group = None  # set by torch_parallel.apply_cp: K/V all-gathered over it

    def gather_cp(self, x: torch.Tensor) -> torch.Tensor:
        """``x [1, S_loc, heads, D]`` of every cp rank, concatenated along the sequence (rank order)."""
        if self.cp_group is None:
            return x
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        return all_gather_tensor_autograd(x.contiguous(), gather_dim=1, group=self.cp_group)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: DocLayout) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.head_dim
        q = rope(self.q_proj(x).view(b, s, -1, d).transpose(1, 2), cos, sin)
        k = rope(self.k_proj(x).view(b, s, -1, d).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, s, -1, d)
        k = self.gather_cp(k.transpose(1, 2)).transpose(1, 2)
        v = self.gather_cp(v).transpose(1, 2)
        o = attend(q, k, v, layout)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: DocLayout) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, layout)
        return x + self.mlp(self.mlp_norm(x))


class TorchLlama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, layout: DocLayout) -> torch.Tensor:
        """The last block's output ``[1, S_loc, hidden]`` (before the final norm)."""
        cos, sin = rope_tables(positions, self.cfg, self.norm.weight.dtype)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin, layout)
        return x

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, layout: DocLayout) -> torch.Tensor:
        return self.head(self.norm(self.hidden(tokens, positions, layout)))

    def load_full(self, full: nn.Module) -> None:
        """Copy the weights of a single-process :class:`flashpar.models.Llama` (call before parallelizing)."""
        weights = dict(full.named_parameters())
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(weights[full_name(name, self.cfg)])


_BLOCK_PARTS = ("attn", "mlp")  # the peer's submodules of a block; flashpar's Llama keeps their layers on the block


def full_name(name: str, cfg: LlamaConfig) -> str:
    """The single-process Llama's name of parameter ``name`` (``blocks.3.attn.q_proj.weight`` ->
    ``blocks.3.q_proj.weight``; ``head.weight`` -> ``embed.weight`` when tied)."""
    if name == "head.weight" and cfg.tie_embeddings:
        return "embed.weight"
    for part in _BLOCK_PARTS:
        name = name.replace(f".{part}.", ".")
    return name
