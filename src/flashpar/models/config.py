"""``LlamaConfig``: the sizes and features of a Llama-style decoder, a tiny CPU default, and Hugging Face configs.

``LlamaConfig.from_hf(path)`` reads a Hugging Face ``config.json`` (the file, or a folder holding it) of a
family of ``flashpar.models.families`` (Llama, Mistral, Qwen2, Qwen3) as plain JSON, so describing a real model
needs no ``transformers`` install.  It reads ``rope_theta`` and the rope scaling wherever transformers 4 or 5
writes them (``flashpar.models.rope_scaling``: default, linear, llama3, YaRN; the frequencies:
``flashpar.models.rope``), ``head_dim``, the family's biases, q/k norm and sliding windows, and
``max_position_embeddings``, and refuses, with one line naming the field, what the model does not implement:
another ``model_type``, an activation other than SiLU, another rope type, a partial rotary factor, malformed
values.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from flashpar.models.families import FAMILIES, check_features, read_features
from flashpar.models.rope_scaling import (
    ROPE_TYPES,
    LinearScaling,
    RopeScaling,
    Scaling,
    YarnScaling,
    parse_rope,
    scaling_of,
)

__all__ = ["ROPE_TYPES", "LinearScaling", "LlamaConfig", "RopeScaling", "YarnScaling", "hf_fields"]



def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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
    # Hugging Face models: rope rescaling (None: plain rope; flashpar.models.rope_scaling) and
    # max_position_embeddings (recorded for export; flashpar does not cap the sequence length with it)
    rope_scaling: Scaling | None = None
    max_positions: int = 2048
    # the family (Hugging Face model_type) and the features it switches on (flashpar.models.families); a
    # checkpoint's meta.json written without them reads as plain Llama
    family: str = "llama"
    qkv_bias: bool = False  # biases of q_proj, k_proj, v_proj
    o_bias: bool = False  # bias of o_proj
    mlp_bias: bool = False  # biases of gate, up, down
    qk_norm: bool = False  # RMSNorm of each head's q and k (weight [head_dim]) before rope
    windows: tuple[int, ...] = ()  # per layer, the sliding window (0: full attention); (): none

    def __post_init__(self) -> None:
        object.__setattr__(self, "rope_scaling", scaling_of(self.rope_scaling))  # a dict: from to_dict()
        object.__setattr__(self, "windows", tuple(self.windows))  # a list: from to_dict() through JSON
        if any(not _integer(w) or w < 0 for w in self.windows) or len(self.windows) not in (0, self.layers):
            raise ValueError(f"LlamaConfig: windows must be one integer >= 0 per layer ({self.layers}), got "
                             f"{list(self.windows)}")
        for name in ("qkv_bias", "o_bias", "mlp_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LlamaConfig: {name} must be true or false, got {getattr(self, name)!r}")
        if not _number(self.rope_theta) or not self.rope_theta > 0:
            raise ValueError(f"LlamaConfig: rope_theta must be a positive number, got {self.rope_theta!r}")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden // max(self.heads, 1))
        bad = [f"{name} = {getattr(self, name)}" for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads",
                                                              "ffn", "head_dim", "max_positions")
               if getattr(self, name) < 1]
        if bad:
            raise ValueError(f"LlamaConfig: sizes must be positive: {', '.join(bad)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"LlamaConfig: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: rotary embeddings need an even head_dim, got {self.head_dim}")
        check_features(self)

    @property
    def block_matmul_params(self) -> int:
        """Projection weights of one block: q, k, v, o and the SwiGLU gate, up and down."""
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        return attn + 3 * self.hidden * self.ffn

    @property
    def block_vector_params(self) -> int:
        """Vectors of one block: two norms, the biases and the q/k norms its family has."""
        d = self.head_dim
        return (2 * self.hidden + self.qkv_bias * (self.heads + 2 * self.kv_heads) * d + self.o_bias * self.hidden
                + self.mlp_bias * (2 * self.ffn + self.hidden) + self.qk_norm * 2 * d)

    @property
    def params(self) -> int:
        """Parameter count: the blocks (projections and vectors), the embedding (and untied head), the final norm."""
        embed = self.vocab_size * self.hidden * (1 if self.tie_embeddings else 2)
        return self.layers * (self.block_matmul_params + self.block_vector_params) + embed + self.hidden

    @property
    def matmul_params(self) -> int:
        """Weights used in matmuls per token: the blocks' projections and the output head."""
        return self.layers * self.block_matmul_params + self.hidden * self.vocab_size

    def flops_per_token(self, keys_per_token: float) -> float:
        """Model FLOPs of one token, forward + backward (3x the forward): ``6 matmul_params`` plus causal
        attention, ``12 layers heads head_dim k`` with ``k`` the mean number of keys a query attends to
        (pairs of the causal document mask / tokens)."""
        return 6.0 * self.matmul_params + 12.0 * self.layers * self.heads * self.head_dim * keys_per_token

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling.rope_type

    def to_dict(self) -> dict:
        """The fields as JSON values (``rope_scaling``: a dict or None); ``LlamaConfig(**d)`` inverts it."""
        d = asdict(self)
        d["windows"] = list(self.windows)
        return d

    @classmethod
    def from_hf(cls, path) -> LlamaConfig:
        """From a Hugging Face Llama ``config.json`` (or the folder that holds it); ``ValueError`` (one line
        naming the field) for what flashpar does not implement or a malformed value."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"LlamaConfig.from_hf: no config.json at {path}")
        try:
            d = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"LlamaConfig.from_hf: {p} is not a JSON file: {err}") from None
        if not isinstance(d, dict):
            raise ValueError(f"LlamaConfig.from_hf: {p} holds {type(d).__name__}, not a JSON object")
        try:
            return cls(**hf_fields(d))
        except ValueError as err:
            raise ValueError(f"LlamaConfig.from_hf: {p}: {err}") from None


def hf_fields(d: dict) -> dict:
    """``LlamaConfig``'s fields from a Hugging Face config (a dict) of a family of ``flashpar.models.families``;
    ``ValueError`` naming the field."""

    def get(key, kind, default=None):
        if key not in d or (d[key] is None and default is not None):
            if default is None:
                raise ValueError(f"lacks {key!r} (is it a decoder config?)")
            return default
        value = d[key]
        ok = _integer(value) if kind is int else _number(value) if kind is float else isinstance(value, kind)
        if not ok:
            raise ValueError(f"{key} = {value!r} is not {'an integer' if kind is int else 'a ' + kind.__name__}")
        return value

    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act = {act!r} is not supported (only 'silu')")
    heads, hidden, layers = get("num_attention_heads", int), get("hidden_size", int), get("num_hidden_layers", int)
    features = read_features(d, layers)
    max_positions = get("max_position_embeddings", int, 2048)
    theta, scaling = parse_rope(d, max_positions)
    head_dim = FAMILIES[features["family"]].head_dim or (hidden // heads if heads > 0 else 0)
    return {"vocab_size": get("vocab_size", int), "hidden": hidden, "layers": layers,
            "heads": heads, "kv_heads": get("num_key_value_heads", int, heads),
            "ffn": get("intermediate_size", int), "head_dim": get("head_dim", int, head_dim),
            "rope_theta": float(theta), "norm_eps": float(get("rms_norm_eps", float, 1e-6)),
            "tie_embeddings": get("tie_word_embeddings", bool, False),
            "init_std": float(get("initializer_range", float, 0.02)), "rope_scaling": scaling,
            "max_positions": max_positions, **features}
