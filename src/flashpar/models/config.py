"""``LlamaConfig``: the sizes of a Llama-style decoder, a tiny CPU default, and Hugging Face configs.

``LlamaConfig.from_hf(path)`` reads a Hugging Face Llama ``config.json`` (the file, or a folder
holding it) as plain JSON, so describing a real model needs no ``transformers`` install.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256  # byte-level tokens of flashpar.corpus
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 176
    head_dim: int = 0  # 0: hidden // heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden // max(self.heads, 1))
        bad = [f"{name} = {getattr(self, name)}" for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads",
                                                              "ffn", "head_dim") if getattr(self, name) < 1]
        if bad:
            raise ValueError(f"LlamaConfig: sizes must be positive: {', '.join(bad)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"LlamaConfig: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: rotary embeddings need an even head_dim, got {self.head_dim}")

    @property
    def block_matmul_params(self) -> int:
        """Projection weights of one block: q, k, v, o and the SwiGLU gate, up and down."""
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        return attn + 3 * self.hidden * self.ffn

    @property
    def params(self) -> int:
        """Parameter count: the blocks (projections and two norms), the embedding (and untied head), the final norm."""
        embed = self.vocab_size * self.hidden * (1 if self.tie_embeddings else 2)
        return self.layers * (self.block_matmul_params + 2 * self.hidden) + embed + self.hidden

    @property
    def matmul_params(self) -> int:
        """Weights used in matmuls per token: the blocks' projections and the output head."""
        return self.layers * self.block_matmul_params + self.hidden * self.vocab_size

    def flops_per_token(self, keys_per_token: float) -> float:
        """Model FLOPs of one token, forward + backward (3x the forward): ``6 matmul_params`` plus causal
        attention, ``12 layers heads head_dim k`` with ``k`` the mean number of keys a query attends to
        (pairs of the causal document mask / tokens)."""
        return 6.0 * self.matmul_params + 12.0 * self.layers * self.heads * self.head_dim * keys_per_token

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf(cls, path) -> LlamaConfig:
        """From a Hugging Face Llama ``config.json`` (or the folder that holds it)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"LlamaConfig.from_hf: no config.json at {path}")
        d = json.loads(p.read_text())
        try:
            heads = d["num_attention_heads"]
            return cls(vocab_size=d["vocab_size"], hidden=d["hidden_size"], layers=d["num_hidden_layers"], heads=heads,
                       kv_heads=d.get("num_key_value_heads", heads), ffn=d["intermediate_size"],
                       head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                       rope_theta=float(d.get("rope_theta", 10000.0)), norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                       tie_embeddings=bool(d.get("tie_word_embeddings", False)),
                       init_std=float(d.get("initializer_range", 0.02)))
        except KeyError as err:
            raise ValueError(f"LlamaConfig.from_hf: {p} lacks {err.args[0]!r} (is it a Llama config?)") from err
