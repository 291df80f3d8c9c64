"""Rotary embeddings: the frequencies of a ``LlamaConfig``, their cos / sin tables and the rotation, ONE place,
read by ``Llama``, by ``ParallelLlama`` and inference's decode through ``flashpar.models.fused`` (the tables
once per step, the rotation as one autograd node), and by the torch baseline of ``flashpar bench train``.

Plain rope (``rope_type: "default"``), head dim ``D``, base ``theta``::

    f_i = theta^(-2i / D),   i = 0 .. D/2 - 1          (angle of pair i at position p: p f_i)

Llama 3.1's rescaling (``rope_type: "llama3"``; ``RopeScaling``: factor ``s``, low / high frequency
factors ``a < b``, original context ``L``) stretches the long wavelengths ``w_i = 2 pi / f_i`` by
``s`` and leaves the short ones, with a linear blend in between::

    w_i < L / b:          f'_i = f_i                                  (high frequencies: unchanged)
    w_i > L / a:          f'_i = f_i / s                              (low frequencies: s times slower)
    otherwise:            f'_i = (1 - m) f_i / s + m f_i,   m = (L / w_i - a) / (b - a)   (m runs 0 -> 1)

Position interpolation (``rope_type: "linear"``, factor ``s``): ``f'_i = f_i / s``.

YaRN (``rope_type: "yarn"``; factor ``s``, original context ``L``, ``beta_fast``, ``beta_slow``) interpolates the
low frequencies and keeps the high ones, with a linear ramp over the pair index ``i`` in between, and scales
cos and sin by ``m`` (``YarnScaling.scale``; q.k then carries ``m^2``)::

    d(r)  = D ln(L / (2 pi r)) / (2 ln theta)           the pair index that turns r times over L positions
    lo    = max(floor(d(beta_fast)), 0),  hi = min(ceil(d(beta_slow)), D - 1)   (truncate=false: no floor / ceil)
    ramp_i = clamp((i - lo) / (hi - lo), 0, 1)          (hi = lo: hi + 0.001)
    f'_i  = f_i (1 - ramp_i) + (f_i / s) ramp_i

          f'/f
      1 --------.                      pairs below lo: turn more than beta_fast times over L, kept
                 `.
                   `.
    1/s              `--------         pairs above hi: turn fewer than beta_slow times, interpolated
         0      lo    hi     D/2 - 1

The frequencies and angles are computed in float64; the tables are cast to the activations' dtype
(``rotary_tables``).  The rotation is Llama's half-split form: ``x = [x1 | x2]`` along the head dimension,
``c = cos(p f)``, ``s = sin(p f)``::

    rotate(x) = [x1 c - x2 s | x2 c + x1 s] = x [c | c] + [-x2 | x1] [s | s]
"""

from __future__ import annotations

import math

import torch

from flashpar.models.config import LinearScaling, LlamaConfig, RopeScaling, YarnScaling


def default_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """Plain rope's frequencies ``f_i = theta^(-2i / D)``, ``i < D / 2`` (float64); a model's, with its
    rope scaling: ``inverse_frequencies``."""
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)


def llama3_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """``f'`` of the module docstring from the plain frequencies ``inv_freq [D/2]``."""
    s, a, b = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    blend = (old / wavelen - a) / (b - a)
    mid = (1 - blend) * inv_freq / s + blend * inv_freq
    return torch.where(wavelen < old / b, inv_freq, torch.where(wavelen > old / a, inv_freq / s, mid))


def yarn_frequencies(inv_freq: torch.Tensor, scaling: YarnScaling, theta: float) -> torch.Tensor:
    """YaRN's ``f'`` of the module docstring from the plain frequencies ``inv_freq [D/2]`` with base ``theta``."""
    d, s, big = 2 * inv_freq.shape[0], scaling.factor, scaling.original_max_position_embeddings
    fast, slow = scaling.betas

    def pair(turns: float) -> float:
        return d * math.log(big / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = pair(fast), pair(slow)
    if scaling.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001  # a ramp of zero width: transformers' step
    i = torch.arange(d // 2, dtype=torch.float64, device=inv_freq.device)
    ramp = ((i - lo) / (hi - lo)).clamp(0, 1)
    return inv_freq * (1 - ramp) + inv_freq / s * ramp


def inverse_frequencies(cfg: LlamaConfig, device=None) -> torch.Tensor:
    """The rotary frequencies ``[head_dim / 2]`` (float64) of ``cfg``: plain, linear, llama3 or YaRN."""
    inv_freq = default_frequencies(cfg.head_dim, cfg.rope_theta, device)
    scaling = cfg.rope_scaling
    if isinstance(scaling, RopeScaling):
        return llama3_frequencies(inv_freq, scaling)
    if isinstance(scaling, LinearScaling):
        return inv_freq / scaling.factor
    if isinstance(scaling, YarnScaling):
        return yarn_frequencies(inv_freq, scaling, cfg.rope_theta)
    return inv_freq


def table_scale(cfg: LlamaConfig) -> float:
    """The factor on cos and sin: YaRN's attention factor, else 1."""
    return cfg.rope_scaling.scale if isinstance(cfg.rope_scaling, YarnScaling) else 1.0


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                  scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale cos, scale sin)`` of the angles ``positions [S] x inv_freq [D/2]`` (``[S, D/2]``), computed in
    float64 and returned in ``dtype``."""
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Rotary embedding (the module docstring's half-split form) of ``x [..., S, D]`` at ``positions [S]`` with
    the frequencies ``inv_freq [D/2]`` (``inverse_frequencies``): ``x cos(p f) + rotate_half(x) sin(p f)``, both
    tables times ``scale`` (``table_scale``)."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {d}")
    if inv_freq.shape != (d // 2,):
        raise ValueError(f"rotate: inv_freq has shape {tuple(inv_freq.shape)}, expected ({d // 2},)")
    cos, sin = rotary_tables(positions, inv_freq, x.dtype, scale)  # inv_freq on x's device
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + half * sin
