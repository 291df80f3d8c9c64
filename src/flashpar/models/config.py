"""``LlamaConfig``: the sizes of a Llama-style decoder, a tiny CPU default, and Hugging Face configs.

``LlamaConfig.from_hf(path)`` reads a Hugging Face Llama ``config.json`` (the file, or a folder
holding it) as plain JSON, so describing a real model needs no ``transformers`` install.  It reads
``rope_theta`` at the top level or under ``rope_parameters`` (transformers 5) / ``rope_scaling``
(transformers 4), the rope types ``"default"`` and ``"llama3"`` (``RopeScaling``; the frequencies:
``flashpar.models.rope``) and ``max_position_embeddings``, and refuses, with one line naming the
field, what the model does not implement: another ``model_type``, attention or MLP biases, an
activation other than SiLU, another rope type, a partial rotary factor, malformed values.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

ROPE_TYPES = ("default", "llama3")  # what flashpar.models.rope implements


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rescaling of the rotary frequencies (``rope_type: "llama3"``; math in
    ``flashpar.models.rope``).  Field names as in Hugging Face's ``rope_parameters``."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            raise ValueError(f"RopeScaling: rope_type must be 'llama3', got {self.rope_type!r}")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            if not _number(getattr(self, name)) or not getattr(self, name) > 0:
                raise ValueError(f"RopeScaling: {name} must be a positive number, got {getattr(self, name)!r}")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"RopeScaling: high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                             f"({self.low_freq_factor})")
        if not _integer(self.original_max_position_embeddings) or self.original_max_position_embeddings < 1:
            raise ValueError("RopeScaling: original_max_position_embeddings must be a positive integer, got "
                             f"{self.original_max_position_embeddings!r}")


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
    # Hugging Face models: llama3 rope rescaling (None: plain rope) and max_position_embeddings (recorded for
    # export; flashpar does not cap the sequence length with it)
    rope_scaling: RopeScaling | None = None
    max_positions: int = 2048

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # from to_dict() (a checkpoint's meta.json)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"LlamaConfig: rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
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

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling.rope_type

    def to_dict(self) -> dict:
        """The fields as JSON values (``rope_scaling``: a dict or None); ``LlamaConfig(**d)`` inverts it."""
        return asdict(self)

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
    """``LlamaConfig``'s fields from a Hugging Face Llama config (a dict); ``ValueError`` naming the field."""

    def get(key, kind, default=None):
        if key not in d or (d[key] is None and default is not None):
            if default is None:
                raise ValueError(f"lacks {key!r} (is it a Llama config?)")
            return default
        value = d[key]
        ok = _integer(value) if kind is int else _number(value) if kind is float else isinstance(value, kind)
        if not ok:
            raise ValueError(f"{key} = {value!r} is not {'an integer' if kind is int else 'a ' + kind.__name__}")
        return value

    if d.get("model_type", "llama") != "llama":
        raise ValueError(f"model_type = {d['model_type']!r} is not supported (only 'llama')")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key, False) is not False:
            raise ValueError(f"{key} = {d[key]!r} is not supported (flashpar's projections have no bias)")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act = {act!r} is not supported (only 'silu')")
    heads, hidden = get("num_attention_heads", int), get("hidden_size", int)
    max_positions = get("max_position_embeddings", int, 2048)
    theta, scaling = _rope(d, max_positions)
    return {"vocab_size": get("vocab_size", int), "hidden": hidden, "layers": get("num_hidden_layers", int),
            "heads": heads, "kv_heads": get("num_key_value_heads", int, heads),
            "ffn": get("intermediate_size", int),
            "head_dim": get("head_dim", int, hidden // heads if heads > 0 else 0),
            "rope_theta": float(theta), "norm_eps": float(get("rms_norm_eps", float, 1e-6)),
            "tie_embeddings": get("tie_word_embeddings", bool, False),
            "init_std": float(get("initializer_range", float, 0.02)), "rope_scaling": scaling,
            "max_positions": max_positions}


def _rope(d: dict, max_positions: int) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from the top level and ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` (transformers 4: the scaling only)."""
    given = [key for key in ("rope_parameters", "rope_scaling") if d.get(key) is not None]
    params: dict = {}
    for key in given:
        if not isinstance(d[key], dict):
            raise ValueError(f"{key} = {d[key]!r} is not a JSON object")
        if params and d[key] != params:
            raise ValueError(f"rope_parameters and rope_scaling disagree: {params} != {d[key]}")
        params = d[key]
    where = given[0] if given else "rope_parameters"
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{where}: rope parameters per layer type are not supported")
    thetas = {key: v for key, v in (("rope_theta", d.get("rope_theta")), (f"{where}.rope_theta",
                                                                       params.get("rope_theta"))) if v is not None}
    for key, v in thetas.items():
        if not _number(v) or not v > 0:
            raise ValueError(f"{key} = {v!r} is not a positive number")
    if len(set(thetas.values())) > 1:
        raise ValueError(f"rope_theta disagrees: {thetas}")
    theta = next(iter(thetas.values()), 10000.0)  # transformers' default
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"{where}.rope_type = {kind!r} is not supported (only {', '.join(map(repr, ROPE_TYPES))})")
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor = {partial!r} is not supported (only 1.0)")
    if kind == "default":
        return theta, None
    args = {}
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        if name not in params:
            raise ValueError(f"{where} lacks {name!r} (rope_type 'llama3')")
        args[name] = params[name]
    args["original_max_position_embeddings"] = params.get("original_max_position_embeddings", max_positions)
    try:
        return theta, RopeScaling(**args)
    except ValueError as err:
        raise ValueError(f"{where}: {str(err).removeprefix('RopeScaling: ')}") from None
