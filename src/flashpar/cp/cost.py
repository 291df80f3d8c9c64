"""The FlashCP cost model: work, bytes and estimated time per rank of a context-parallel plan.

Shared by the planner (to score candidates), the execution benchmarks and the simulator.
Everything is per transformer layer and per forward pass (the backward scales attention and
linear work alike, so ratios between plans do not change).

    attention flops of a (query, key) pair   4 heads head_dim            (Q K^T and P V, 2 flops per MAC)
    linear flops per token                    2 [hidden (heads + 2 kv_heads) head_dim      QKV
                                                 + heads head_dim hidden                   output projection
                                                 + 3 hidden ffn]                           SwiGLU MLP
    K/V bytes of one token                    2 kv_heads head_dim dtype_bytes
    attention task time   pairs * 4 h d / (flops * eff(q_len, k_len))
    eff(q, k)             attn_peak * q / (q + attn_half) * k / (k + attn_half)
    rank time             max(compute, comm + compute that needs remote K/V)      local-first overlap
    step time             max over ranks

The efficiency curve approximates FlashAttention-2's published forward throughput (causal,
head dim 128): roughly half of the long-sequence rate at 512 tokens, near the plateau beyond 8K,
the plateau at about 60% of the device peak.  ``flashpar bench`` replaces it by measured values
on a GPU.  Defaults: a Llama-3-8B layer (hidden 4096, FFN 14336, 32 heads, 8 kv heads, head dim
128, bf16) on an H100-class GPU (989 TFLOP/s dense bf16) with a 400 Gb/s link (50 GB/s).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CostModel:
    hidden: int = 4096
    ffn: int = 14336
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    layers: int = 1
    dtype_bytes: int = 2
    flops: float = 989e12  # device FLOP/s (dense, dtype above)
    bandwidth: float = 50e9  # link bytes/s per rank (400 Gb/s)
    linear: bool = True  # False: attention work alone (to compare with solvers that balance only attention)
    attn_peak: float = 0.6  # fraction of ``flops`` a long attention kernel reaches
    attn_half: float = 256.0  # query / key length at which a kernel runs at half its plateau
    linear_eff: float = 0.7  # fraction of ``flops`` the linear layers reach

    @functools.cached_property
    def flops_per_pair(self) -> float:
        return 4.0 * self.heads * self.head_dim * self.layers

    @functools.cached_property
    def flops_per_token(self) -> float:
        if not self.linear:
            return 0.0
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        out = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.ffn
        return 2.0 * (qkv + out + mlp) * self.layers

    @functools.cached_property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes * self.layers

    def efficiency(self, q_len: int, k_len: int) -> float:
        h = self.attn_half
        return self.attn_peak * (q_len / (q_len + h)) * (k_len / (k_len + h))

    def attn_time(self, pairs: float, q_len: int, k_len: int) -> float:
        if pairs <= 0:
            return 0.0
        return pairs * self.flops_per_pair / (self.flops * self.efficiency(q_len, k_len))

    def linear_time(self, tokens: int) -> float:
        return tokens * self.flops_per_token / (self.flops * self.linear_eff)

    def comm_time(self, kv_tokens: int) -> float:
        return kv_tokens * self.kv_bytes_per_token / self.bandwidth

    def to_dict(self) -> dict:
        return asdict(self)
