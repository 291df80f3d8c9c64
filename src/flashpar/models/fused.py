"""The elementwise parts of ``ParallelBlock`` as one autograd node each: RoPE on the fused q/k/v output and
SwiGLU on the fused gate/up output.

Written with plain ops, autograd would split each fused GEMM output into views (whose backward
concatenates the pieces' gradients: one copy of the whole output), build ``rotate_half`` from a
``cat`` and a ``neg`` (and, in backward, zero-filled slices of full size), recompute the cos / sin
tables in every layer, and keep ``silu(g)`` for backward beside ``g`` and ``u``.  Here:

RoPE (Llama's half-split form; ``x = [x1 | x2]`` along the head dimension, ``c = cos(p f)``,
``s = sin(p f)`` of the ``D / 2`` frequencies at each token's position ``p``)::

    y1 = x1 c - x2 s          dx1 =  dy1 c + dy2 s
    y2 = x2 c + x1 s          dx2 = -dy1 s + dy2 c

The tables are made once per step (``rope_tables``: ``flashpar.models.rope.rotary_tables``, the ones
``rotate`` uses, in float64, then cast to the compute dtype) and shared by every layer.  ``rope_qkv``
takes the q/k/v GEMM's output ``[T, (H + 2 H_kv) D]`` and returns ``q [T, H, D]`` and ``k [T, H_kv, D]``
rotated and ``v`` as a copy; its backward writes ``dq``, ``dk`` (rotated back) and ``dv`` straight into
their columns of one ``d_qkv``::

    qkv  [T | q heads ........ | k heads .. | v heads .. ]
    d_qkv[T | rot^-1(dq) ..... | rot^-1(dk) | dv ....... ]   one buffer, no cat

SwiGLU on ``gu = [g | u]`` (``[T, 2F]``, the gate/up GEMM's output)::

    y = silu(g) u,     du = dy silu(g),     dg = dy u silu'(g)   (aten.silu_backward)

It keeps ``gu`` and ``silu(g)`` for backward, as autograd would (recomputing ``silu`` costs more on CPU than
the ``cat`` it replaces: measured 8 ms against 4 at the bench's ``[3904, 704]``), and writes ``dg`` and ``du``
into the halves of one ``d_gu``.
"""

from __future__ import annotations

import torch

from flashpar.models.config import LlamaConfig
from flashpar.models.rope import inverse_frequencies, rotary_tables, table_scale


def rope_tables(positions: torch.Tensor, cfg: LlamaConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of ``positions [T] x cfg's frequencies [D / 2]`` (``[T, D / 2]``, computed in float64, in
    ``dtype``): the tables every layer's ``rope_qkv`` of one step uses."""
    return rotary_tables(positions, inverse_frequencies(cfg, positions.device), dtype, table_scale(cfg))


def _rotate_into(out: torch.Tensor, x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, sign: float) -> torch.Tensor:
    """``out = rot(x)`` (``sign = 1``) or ``rot^-1(x)`` (``sign = -1``) for ``x, out [T, heads, D]`` and tables
    ``c, s [T, 1, D / 2]``: ``out1 = x1 c - sign x2 s``, ``out2 = x2 c + sign x1 s``."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    torch.mul(x1, c, out=out[..., :h]).addcmul_(x2, s, value=-sign)
    torch.mul(x2, c, out=out[..., h:]).addcmul_(x1, s, value=sign)
    return out


class _RopeQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, heads, kv_heads):
        t, d = qkv.shape[0], qkv.shape[1] // (heads + 2 * kv_heads)
        nq, nk = heads * d, kv_heads * d
        c, s = cos[:, None, :], sin[:, None, :]
        q = _rotate_into(qkv.new_empty(t, heads, d), qkv[:, :nq].view(t, heads, d), c, s, 1.0)
        k = _rotate_into(qkv.new_empty(t, kv_heads, d), qkv[:, nq : nq + nk].view(t, kv_heads, d), c, s, 1.0)
        v = qkv[:, nq + nk :].reshape(t, kv_heads, d).clone(memory_format=torch.contiguous_format)
        ctx.save_for_backward(cos, sin)
        ctx.dims = (heads, kv_heads, d)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        heads, kv_heads, d = ctx.dims
        t = cos.shape[0]
        nq, nk = heads * d, kv_heads * d
        like = next(g for g in (dq, dk, dv) if g is not None)
        d_qkv = like.new_empty(t, nq + 2 * nk)
        c, s = cos[:, None, :], sin[:, None, :]
        for g, lo, n in ((dq, 0, heads), (dk, nq, kv_heads)):
            out = d_qkv[:, lo : lo + n * d].view(t, n, d)
            if g is None:
                out.zero_()
            else:
                _rotate_into(out, g, c, s, -1.0)
        if dv is None:
            d_qkv[:, nq + nk :].zero_()
        else:
            d_qkv[:, nq + nk :].view(t, kv_heads, d).copy_(dv)
        return d_qkv, None, None, None, None


def rope_qkv(qkv: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], heads: int,
             kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q [T, heads, D]``, ``k [T, kv_heads, D]`` rotated by ``tables`` (``rope_tables``) and ``v [T, kv_heads,
    D]`` from the q/k/v GEMM's output ``qkv [T, (heads + 2 kv_heads) D]`` (columns: q heads, k heads, v heads)."""
    cos, sin = tables
    rows = heads + 2 * kv_heads
    if qkv.dim() != 2 or qkv.shape[1] % rows or (qkv.shape[1] // rows) != 2 * cos.shape[1]:
        raise ValueError(f"rope_qkv: qkv {tuple(qkv.shape)} is not [T, {rows} x head_dim] with head_dim "
                         f"{2 * cos.shape[1]} (tables {tuple(cos.shape)})")
    if cos.shape[0] != qkv.shape[0]:
        raise ValueError(f"rope_qkv: tables for {cos.shape[0]} tokens, qkv has {qkv.shape[0]}")
    return _RopeQKV.apply(qkv, cos, sin, heads, kv_heads)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu):
        f = gu.shape[-1] // 2
        g, u = gu[..., :f], gu[..., f:]
        s = torch.nn.functional.silu(g)
        ctx.save_for_backward(gu, s)
        return s * u

    @staticmethod
    def backward(ctx, dy):
        gu, s = ctx.saved_tensors
        f = gu.shape[-1] // 2
        g, u = gu[..., :f], gu[..., f:]
        d_gu = torch.empty_like(gu)
        torch.mul(dy, s, out=d_gu[..., f:])
        torch.ops.aten.silu_backward.grad_input(dy * u, g, grad_input=d_gu[..., :f])
        return d_gu


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` of ``gu = [g | u]`` (last dimension ``2F``, the gate/up GEMM's output): ``[..., F]``."""
    if gu.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dimension {gu.shape[-1]} of gate/up is odd")
    return _SwiGLU.apply(gu)
