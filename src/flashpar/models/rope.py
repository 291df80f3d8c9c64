"""The rotary frequencies of a ``LlamaConfig``: ONE place, read by ``Llama``, ``ParallelLlama`` and the
torch baseline of ``flashpar bench train`` (the rotation itself: ``flashpar.overlap.ulysses.rotate``).

Plain rope (``rope_type: "default"``), head dim ``D``, base ``theta``::

    f_i = theta^(-2i / D),   i = 0 .. D/2 - 1          (angle of pair i at position p: p f_i)

Llama 3.1's rescaling (``rope_type: "llama3"``; ``RopeScaling``: factor ``s``, low / high frequency
factors ``a < b``, original context ``L``) stretches the long wavelengths ``w_i = 2 pi / f_i`` by
``s`` and leaves the short ones, with a linear blend in between::

    w_i < L / b:          f'_i = f_i                                  (high frequencies: unchanged)
    w_i > L / a:          f'_i = f_i / s                              (low frequencies: s times slower)
    otherwise:            f'_i = (1 - m) f_i / s + m f_i,   m = (L / w_i - a) / (b - a)   (m runs 0 -> 1)

The frequencies are computed in float64 (the rotation casts cos / sin to the activations' dtype).
"""

from __future__ import annotations

import math

import torch

from flashpar.models.config import LlamaConfig, RopeScaling
from flashpar.overlap.ulysses import default_frequencies


def llama3_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """``f'`` of the module docstring from the plain frequencies ``inv_freq [D/2]``."""
    s, a, b = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    blend = (old / wavelen - a) / (b - a)
    mid = (1 - blend) * inv_freq / s + blend * inv_freq
    return torch.where(wavelen < old / b, inv_freq, torch.where(wavelen > old / a, inv_freq / s, mid))


def inverse_frequencies(cfg: LlamaConfig, device=None) -> torch.Tensor:
    """The rotary frequencies ``[head_dim / 2]`` (float64) of ``cfg``: plain, or llama3-rescaled."""
    inv_freq = default_frequencies(cfg.head_dim, cfg.rope_theta, device)
    return inv_freq if cfg.rope_scaling is None else llama3_frequencies(inv_freq, cfg.rope_scaling)
