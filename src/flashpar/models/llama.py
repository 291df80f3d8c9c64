"""A Llama-style decoder on one process: the reference the parallel model is checked against.

    h_0 = embed(tokens)
    h   = h + o_proj(attn(rope(qn(q_proj(norm(h)))), rope(kn(k_proj(norm(h)))), v_proj(norm(h))))   per block
    h   = h + down(silu(gate(norm(h))) * up(norm(h)))
    logits = head(norm(h))          (head = embed's weight when tied)

Every family of ``flashpar.models.families`` is this model with features switched on: the projections' biases
(``qkv_bias``, ``o_bias``, ``mlp_bias``: each linear ``x W^T + b``), and ``qn`` / ``kn`` (``qk_norm``: an
RMSNorm over each head's ``head_dim`` features, one weight shared by the heads; else the identity).

Attention is causal within each document of the packed sequence (``doc_lens``) and grouped-query
(``kv_heads`` <= ``heads``); rotary embeddings use each token's position inside its document.
Here the document mask is an explicit T x T mask (fine at the trainer's check sizes); the parallel
model runs ``flashpar.cp.attention`` instead.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flashpar.models.config import LlamaConfig
from flashpar.models.rope import inverse_frequencies, rotate, table_scale

IGNORE = -100


def document_positions(doc_lens) -> torch.Tensor:
    """Position of every token inside its document (LongTensor [sum(doc_lens)])."""
    return torch.cat([torch.arange(n) for n in doc_lens]) if len(doc_lens) else torch.empty(0, dtype=torch.long)


def rope(x: torch.Tensor, positions: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    """Rotary embedding of ``x [T, heads, D]`` at ``positions [T]`` with ``cfg``'s frequencies and table scale
    (``flashpar.models.rope``: plain, linear, llama3 or YaRN)."""
    inv_freq = inverse_frequencies(cfg, x.device)
    return rotate(x.transpose(0, 1), positions, inv_freq, table_scale(cfg)).transpose(0, 1)


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor, count: float | None = None) -> torch.Tensor:
    """Summed cross-entropy of ``logits [T, V]`` against ``labels [T]`` (``-100``: no target), divided by
    ``count`` (default: the number of targets here; a trainer passes the global batch's)."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32; fp64 stays fp64
    total = F.cross_entropy(wide, labels, ignore_index=IGNORE, reduction="sum")
    n = int((labels != IGNORE).sum()) if count is None else count
    return total / max(n, 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, computed in fp32 at least (a float64
    reference stays float64), rounded to ``x``'s dtype before the gain (as Hugging Face's Llama does)."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, d = cfg.hidden, cfg.head_dim
        self.cfg = cfg
        self.attn_norm = RMSNorm(h, cfg.norm_eps)
        self.q_proj = nn.Linear(h, cfg.heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.heads * d, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(d, cfg.norm_eps), RMSNorm(d, cfg.norm_eps)
        self.mlp_norm = RMSNorm(h, cfg.norm_eps)
        self.gate = nn.Linear(h, cfg.ffn, bias=cfg.mlp_bias)
        self.up = nn.Linear(h, cfg.ffn, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.ffn, h, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        cfg, t = self.cfg, x.shape[0]
        a = self.attn_norm(x)
        q = self.q_proj(a).view(t, cfg.heads, cfg.head_dim)
        k = self.k_proj(a).view(t, cfg.kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, positions, cfg), rope(k, positions, cfg)
        v = self.v_proj(a).view(t, cfg.kv_heads, cfg.head_dim)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                           enable_gqa=True)
        x = x + self.o_proj(o.transpose(0, 1).reshape(t, -1))
        m = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(m)) * self.up(m))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; output projections scaled by 1 / sqrt(2 layers) (GPT-2 style); norm gains
        one, biases zero."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                out_proj = name.endswith(("o_proj.weight", "down.weight"))
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.layers) if out_proj else std)

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.head is None else self.head.weight

    def forward(self, tokens: torch.Tensor, doc_lens) -> torch.Tensor:
        """Logits ``[T, vocab]`` of one packed sequence ``tokens [T]`` of documents ``doc_lens``."""
        if sum(doc_lens) != tokens.shape[0]:
            raise ValueError(f"Llama: doc_lens add up to {sum(doc_lens)}, tokens has {tokens.shape[0]}")
        positions = document_positions(doc_lens).to(tokens.device)
        doc = torch.repeat_interleave(torch.arange(len(doc_lens), device=tokens.device),
                                      torch.tensor(doc_lens, device=tokens.device))
        t = torch.arange(tokens.shape[0], device=tokens.device)
        mask = (doc[:, None] == doc[None, :]) & (t[None, :] <= t[:, None])
        # a sliding window W keeps the W latest keys of the query's document, itself included: t - t' < W
        banded = {w: mask & (t[:, None] - t[None, :] < w) for w in set(self.cfg.windows) if w}
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            w = self.cfg.windows[i] if self.cfg.windows else 0
            x = block(x, positions, banded[w] if w else mask)
        return F.linear(self.norm(x), self.head_weight())
