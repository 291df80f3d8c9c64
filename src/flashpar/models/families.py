"""The decoder families flashpar runs, one row of settings each, read from and written to Hugging Face configs.

Every family is the same model (``flashpar.models.llama``); a family only switches its features on:

    model_type  class (transformers)   q/k/v bias       o_proj bias      MLP bias   q/k norm  sliding windows
    llama       LlamaForCausalLM       attention_bias   attention_bias   mlp_bias   -         -
    mistral     MistralForCausalLM     -                -                -          -         every layer
    qwen2       Qwen2ForCausalLM       always           -                -          -         from max_window_layers
    qwen3       Qwen3ForCausalLM       attention_bias   attention_bias   -          always    from max_window_layers

The q/k norm is an RMSNorm over each head's ``head_dim`` features of q and of k, before rope (one weight per
``head_dim``, shared by the heads).  Sliding windows are recorded per layer (``LlamaConfig.windows``: 0 a full
layer) from Mistral's ``sliding_window``, or Qwen's ``use_sliding_window``, ``sliding_window``,
``max_window_layers`` and ``layer_types`` (transformers 5 writes the last); each layer attends with its own
(``cp.attention``'s ``window``).  No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class Family:
    """One row of the table: how a family's Hugging Face config spells its features."""

    architecture: str
    attention_bias: bool = False  # "attention_bias" switches the q, k, v and o_proj biases together
    mlp_bias: bool = False  # "mlp_bias" switches the gate, up and down biases
    qkv_bias: bool = False  # q, k, v biases always (o_proj none)
    qk_norm: bool = False
    windows: str = ""  # "", "every" (one sliding_window for all layers), "layers" (Qwen's layer types)
    head_dim: int | None = None  # head_dim when config.json lacks it (None: hidden / heads)


FAMILIES = {
    "llama": Family("LlamaForCausalLM", attention_bias=True, mlp_bias=True),
    "mistral": Family("MistralForCausalLM", windows="every"),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, windows="layers"),
    "qwen3": Family("Qwen3ForCausalLM", attention_bias=True, qk_norm=True, windows="layers", head_dim=128),
}


def check_features(cfg) -> None:
    """``ValueError`` (one line) unless ``cfg``'s features (``qkv_bias``, ``o_bias``, ``mlp_bias``, ``qk_norm``,
    ``windows``) are ones its ``family`` can express."""
    fam = FAMILIES.get(cfg.family)
    if fam is None:
        raise ValueError(f"LlamaConfig: family = {cfg.family!r} is not one of {', '.join(map(repr, FAMILIES))}")
    # attention_bias switches q, k, v and o together; otherwise the family fixes the q/k/v bias and has no o bias
    ok = cfg.qkv_bias == cfg.o_bias if fam.attention_bias else cfg.qkv_bias == fam.qkv_bias and not cfg.o_bias
    bad = [] if ok else ["qkv_bias / o_bias"]
    bad += ["mlp_bias"] if cfg.mlp_bias and not fam.mlp_bias else []
    bad += ["qk_norm"] if cfg.qk_norm != fam.qk_norm else []
    bad += ["windows"] if any(cfg.windows) and not fam.windows else []
    if fam.windows == "every" and len(set(cfg.windows)) > 1:
        bad.append("windows (one window for every layer)")
    if len({w for w in cfg.windows if w}) > 1:
        bad.append("windows (one sliding_window)")
    if bad:
        raise ValueError(f"LlamaConfig: {', '.join(bad)} do not fit family {cfg.family!r} (flashpar.models.families)")


def read_features(d: dict, layers: int) -> dict:
    """``LlamaConfig``'s family fields from a Hugging Face config ``d``; ``ValueError`` naming the field."""
    kind = d.get("model_type", "llama")
    if kind not in FAMILIES:
        raise ValueError(f"model_type = {kind!r} is not supported (only {', '.join(map(repr, FAMILIES))})")
    fam = FAMILIES[kind]
    flags = {}
    for key, allowed in (("attention_bias", fam.attention_bias), ("mlp_bias", fam.mlp_bias)):
        value = d.get(key, False)
        if not isinstance(value, bool):
            raise ValueError(f"{key} = {value!r} is not true or false")
        if value and not allowed:
            raise ValueError(f"{key} = true is not supported for model_type {kind!r}")
        flags[key] = value
    return {"family": kind, "qkv_bias": flags["attention_bias"] or fam.qkv_bias, "o_bias": flags["attention_bias"],
            "mlp_bias": flags["mlp_bias"], "qk_norm": fam.qk_norm, "windows": _read_windows(d, fam, layers)}


def _read_windows(d: dict, fam: Family, layers: int) -> tuple[int, ...]:
    """Per layer the sliding window (0: full attention), as transformers builds each family's masks."""
    if not fam.windows:
        return ()
    if fam.windows == "every":  # Mistral: one window on every layer, 4096 when the file does not say
        window = d.get("sliding_window", 4096)
        return (_window(window),) * layers if window is not None else ()
    window = d.get("sliding_window", 4096) if d.get("use_sliding_window", False) else None
    types = d.get("layer_types")
    if types is None:
        first = d.get("max_window_layers", 28)
        if not isinstance(first, int) or isinstance(first, bool):
            raise ValueError(f"max_window_layers = {first!r} is not an integer")
        types = [SLIDING if window is not None and i >= first else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in (FULL, SLIDING) for t in types):
        raise ValueError(f"layer_types = {types!r} is not {layers} of {FULL!r} / {SLIDING!r}")
    if window is None:
        return ()
    windows = tuple(_window(window) if t == SLIDING else 0 for t in types)
    return windows if any(windows) else ()


def _window(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"sliding_window = {value!r} is not a positive integer")
    return value


def write_features(cfg) -> dict:
    """The Hugging Face config fields of ``cfg``'s family and features (``check_features`` holds)."""
    fam = FAMILIES[cfg.family]
    out: dict = {"model_type": cfg.family, "architectures": [fam.architecture]}
    if fam.attention_bias:
        out["attention_bias"] = cfg.qkv_bias
    if fam.mlp_bias:
        out["mlp_bias"] = cfg.mlp_bias
    windowed = [w for w in cfg.windows if w]
    if fam.windows == "every":
        out["sliding_window"] = windowed[0] if windowed else None
    elif fam.windows == "layers":
        first = next((i for i, w in enumerate(cfg.windows) if w), cfg.layers)
        out.update({"use_sliding_window": bool(windowed), "sliding_window": windowed[0] if windowed else None,
                    "max_window_layers": first,
                    "layer_types": [SLIDING if i < len(cfg.windows) and cfg.windows[i] else FULL
                                    for i in range(cfg.layers)]})
    return out


