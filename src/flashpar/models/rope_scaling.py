"""The rope scalings a ``LlamaConfig`` may carry, and their reading from a Hugging Face config (no torch here).

    rope_type   class           fields (Hugging Face's names in ``rope_parameters`` / ``rope_scaling``)
    "default"   None            -
    "linear"    LinearScaling   factor
    "llama3"    RopeScaling     factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    "yarn"      YarnScaling     factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
                                mscale_all_dim, attention_factor, truncate

The frequencies each gives are in ``flashpar.models.rope``.  ``parse_rope(d, max_positions)`` reads a config's
``rope_theta`` and scaling wherever transformers 4 (top level, ``rope_scaling``) or 5 (``rope_parameters``) writes
them and refuses, with one line naming the field, a rope type or a field flashpar does not implement.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _positive(owner: str, name: str, value) -> None:
    if not _number(value) or not value > 0:
        raise ValueError(f"{owner}: {name} must be a positive number, got {value!r}")


def _context(owner: str, value) -> None:
    if not _integer(value) or value < 1:
        raise ValueError(f"{owner}: original_max_position_embeddings must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rescaling of the rotary frequencies (``rope_type: "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            raise ValueError(f"RopeScaling: rope_type must be 'llama3', got {self.rope_type!r}")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _positive("RopeScaling", name, getattr(self, name))
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"RopeScaling: high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                             f"({self.low_freq_factor})")
        _context("RopeScaling", self.original_max_position_embeddings)


@dataclass(frozen=True)
class LinearScaling:
    """Position interpolation (``rope_type: "linear"``): every frequency divided by ``factor``."""

    factor: float
    rope_type: str = "linear"

    def __post_init__(self) -> None:
        if self.rope_type != "linear":
            raise ValueError(f"LinearScaling: rope_type must be 'linear', got {self.rope_type!r}")
        _positive("LinearScaling", "factor", self.factor)


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (``rope_type: "yarn"``): the frequencies blended between ``f / factor`` and ``f`` by a ramp over the
    dimensions, and cos / sin multiplied by ``attention_factor`` (``scale``); math in ``flashpar.models.rope``.
    ``None`` fields take Hugging Face's defaults (beta_fast 32, beta_slow 1, the attention factor from
    ``factor``, ``mscale`` and ``mscale_all_dim``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    rope_type: str = "yarn"

    def __post_init__(self) -> None:
        if self.rope_type != "yarn":
            raise ValueError(f"YarnScaling: rope_type must be 'yarn', got {self.rope_type!r}")
        _positive("YarnScaling", "factor", self.factor)
        _context("YarnScaling", self.original_max_position_embeddings)
        for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, name) is not None:
                _positive("YarnScaling", name, getattr(self, name))
        if not isinstance(self.truncate, bool):
            raise ValueError(f"YarnScaling: truncate must be true or false, got {self.truncate!r}")

    @property
    def betas(self) -> tuple[float, float]:
        """``(beta_fast, beta_slow)``: the rotations bounding the ramp (defaults 32 and 1)."""
        return self.beta_fast or 32.0, self.beta_slow or 1.0

    @property
    def scale(self) -> float:
        """The factor on cos and sin: ``attention_factor``, else ``m(factor, mscale) / m(factor, mscale_all_dim)``
        when both are given, else ``m(factor, 1)``, with ``m(s, k) = 0.1 k ln s + 1`` (1 for ``s <= 1``)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def m(k: float) -> float:
            return 1.0 if self.factor <= 1 else 0.1 * k * math.log(self.factor) + 1.0

        if self.mscale and self.mscale_all_dim:
            return m(self.mscale) / m(self.mscale_all_dim)
        return m(1.0)


Scaling = RopeScaling | LinearScaling | YarnScaling
KINDS: dict[str, type] = {"linear": LinearScaling, "llama3": RopeScaling, "yarn": YarnScaling}
ROPE_TYPES = ("default", *KINDS)  # what flashpar.models.rope implements


def scaling_of(d: dict | Scaling | None) -> Scaling | None:
    """A scaling from its ``dataclasses.asdict`` (a checkpoint's meta.json) or itself."""
    if d is None or isinstance(d, (RopeScaling, LinearScaling, YarnScaling)):
        return d
    if not isinstance(d, dict) or d.get("rope_type", "llama3") not in KINDS:
        raise ValueError(f"LlamaConfig: rope_scaling must be a rope scaling or None, got {d!r}")
    return KINDS[d.get("rope_type", "llama3")](**d)


def hf_rope(scaling: Scaling | None) -> dict:
    """The Hugging Face ``rope_parameters`` fields of ``scaling`` (without ``rope_theta``); ``None`` fields left out."""
    if scaling is None:
        return {"rope_type": "default"}
    return {k: v for k, v in dataclasses.asdict(scaling).items() if v is not None}


def parse_rope(d: dict, max_positions: int) -> tuple[float, Scaling | None]:
    """``(rope_theta, scaling)`` from the top level and ``rope_parameters`` (transformers 5) or ``rope_scaling``
    (transformers 4: the scaling only) of a Hugging Face config ``d``; ``ValueError`` naming the field."""
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
    cls = KINDS[kind]
    known = {f.name for f in dataclasses.fields(cls)} - {"rope_type"}
    ignored = {"rope_theta", "rope_type", "type", "partial_rotary_factor"}
    extra = sorted(set(params) - known - ignored)
    if extra:
        raise ValueError(f"{where}.{extra[0]} is not supported for rope_type {kind!r}")
    args = {k: v for k, v in params.items() if k in known}
    if kind == "yarn" and args.get("factor") is None:  # transformers: the context ratio
        args["factor"] = max_positions / args.get("original_max_position_embeddings", max_positions)
    if kind in ("llama3", "yarn"):
        # transformers 5 writes a top-level original_max_position_embeddings (Phi-3 style) over the one inside
        args["original_max_position_embeddings"] = d.get("original_max_position_embeddings",
                                                         args.get("original_max_position_embeddings", max_positions))
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    lacking = [name for name in required if name not in args]
    if lacking:
        raise ValueError(f"{where} lacks {lacking[0]!r} (rope_type {kind!r})")
    try:
        return theta, cls(**args)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {str(err).split(': ', 1)[-1]}") from None
