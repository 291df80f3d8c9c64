"""The ``flash`` backend on CUDA: one batch of segment tasks through torch's fused SDPA kernels, which return
the log-sum-exp the merge needs.

A batch arrives as ``[B, H, Lq, D]`` queries and ``[B, H_kv, Lk, D]`` keys and values (``kernels``: query pads
after the real queries, key pads masked by an additive ``[B, 1, 1, Lk]`` mask where a full batch has them).  It
runs on one of two kernels, the ones ``F.scaled_dot_product_attention`` dispatches to on CUDA (their checks:
``mha_fwd`` / ``mha_bwd`` in ``flash_attn/flash_api.cpp``, ``_efficient_attention_forward`` / ``_backward`` in
``attention.cu`` / ``attention_backward.cu`` and ``mem_eff_attention/kernel_forward.h``; their shapes: torch's
meta functions in ``torch/_meta_registrations.py``):

* FlashAttention-2 (``kernel_for`` -> ``"flash"``: fp16 / bf16 operands, no mask, head dim at most 256)::

      aten::_scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, return_debug_mask, *, scale)
          -> (out [B, H, Lq, D], logsumexp [B, H, Lq] float32, cum_seq_q, cum_seq_k, max_q, max_k,
              rng_state, unused, debug_attn_mask)
      aten::_scaled_dot_product_flash_attention_backward(dout, q, k, v, out, logsumexp, cum_seq_q, cum_seq_k,
          max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale) -> (dq, dk, dv)

  GQA native (``H % H_kv == 0``: query head ``h`` reads kv head ``h // (H / H_kv)``, the backward sums dK and dV
  over each kv head's query heads); head dim a multiple of 8; no mask of any kind; ``is_causal`` aligned
  lower-right (query ``i`` sees keys ``j <= i + Lk - Lq``, torch/nn/attention/bias.py's ``causal_lower_right``
  calls this op with ``is_causal=True``).  The backward reads ``logsumexp`` through a raw pointer as a contiguous
  ``[B, H, Lq]`` float32 tensor; ``cum_seq_q`` undefined (``None``) selects the dense, not the varlen, kernel;
  ``rng_state`` / ``unused`` are read only with dropout.
* memory-efficient (xformers' CUTLASS kernel; every other batch: key-padded full batches, band batches of sliding
  windows, fp32, head dim above 256)::

      aten::_scaled_dot_product_efficient_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p,
          is_causal, *, scale) -> (out [B, H, Lq, D], logsumexp [B, H, ceil(Lq / 32) 32] float32, seed, offset)
      aten::_scaled_dot_product_efficient_attention_backward(dout, q, k, v, attn_bias, out, logsumexp, seed,
          offset, dropout_p, grad_input_mask, is_causal, *, scale) -> (dq, dk, dv, dbias)

  fp16, bf16 and fp32; equal query and kv heads (no GQA: K and V are expanded here, their gradients folded
  back); ``attn_bias`` ``[B, H, Lq, Lk]`` of q's dtype, last dimension contiguous, its other strides and its
  pointer aligned (broadcast views allowed: here a ``[B, 1, 1, Lk]`` key mask in rows of ``BIAS_ALIGN``
  elements, expanded); ``is_causal`` aligned upper-left (query ``i`` sees keys ``j <= i``: CausalFromTopLeft);
  rows 16-byte aligned (head dim a multiple of 8 covers every dtype).  Its ``logsumexp`` holds ``Lq`` rounded
  up to 32 columns, those past ``Lq`` ``+inf`` (the forward writes them so that the backward needs no bound
  check): the backward is given the same layout.

Both log-sum-exps are natural logarithms (the kernels work in base 2 and convert: ``m / log2(e) + log(s)``),
of ``scale q k^T`` over the keys a query sees, as ``kernels.merge`` adds them.

Every causal batch is square (``Lq == Lk``: a document piece against itself, padded alike on both sides), where
the two alignments agree; a non-square causal batch is refused.  Head dims that are not a multiple of 8 are
padded with zeros (exact: zero columns add nothing to ``q k^T``, and the output's zero columns are dropped), with
the scale of the true head dim, as SDPA pads.  Dropout is 0 throughout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)
EFFICIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLASH_MAX_HEAD_DIM = 256
HEAD_DIM_STEP = 8  # FlashAttention-2 takes multiples of 8; the efficient kernel rows of 16 bytes (8 half, 4 float)
LSE_ALIGN = 32  # the efficient kernel's logsumexp columns: Lq rounded up to this, +inf past Lq
BIAS_ALIGN = 16  # elements per bias row start: a multiple of the efficient kernel's alignment (8 half, 4 float)


@dataclass(frozen=True)
class Ops:
    """The four kernels, with the aten signatures above (tests run the same calls on stand-ins)."""

    flash_fwd: Callable
    flash_bwd: Callable
    efficient_fwd: Callable
    efficient_bwd: Callable


ATEN = Ops(torch.ops.aten._scaled_dot_product_flash_attention,
           torch.ops.aten._scaled_dot_product_flash_attention_backward,
           torch.ops.aten._scaled_dot_product_efficient_attention,
           torch.ops.aten._scaled_dot_product_efficient_attention_backward)


def unsupported(dtype: torch.dtype) -> str | None:
    """Why no fused CUDA kernel takes operands of ``dtype`` (``None``: one does)."""
    if dtype not in EFFICIENT_DTYPES:
        return f"torch's fused CUDA attention kernels take float16, bfloat16 or float32, got {dtype}"
    return None


def kernel_for(dtype: torch.dtype, head_dim: int, masked: bool) -> str:
    """``"flash"`` (FlashAttention-2) where it can run the batch, else ``"efficient"``."""
    if dtype in FLASH_DTYPES and not masked and _padded_dim(head_dim) <= FLASH_MAX_HEAD_DIM:
        return "flash"
    return "efficient"


def forward(q, k, v, causal: bool, mask, scale: float, ops: Ops | None = None):
    """``(out [B, H, Lq, D] in q's dtype, lse [B, H, Lq] float32)`` of one batch (``mask``: ``[B, 1, 1, Lk]``
    additive key mask of q's dtype, or ``None``; ``ops``: the kernels, ``ATEN`` where ``None``)."""
    ops = ops or ATEN
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    kernel = _checked(q, k, causal, mask)
    qp, kp, vp = (_pad_dim(x) for x in (q, k, v))
    if kernel == "flash":
        out, lse = ops.flash_fwd(qp, kp, vp, 0.0, causal, False, scale=scale)[:2]
    else:
        kp, vp = _expand_heads(kp, H), _expand_heads(vp, H)
        out, lse = ops.efficient_fwd(qp, kp, vp, _bias(mask, B, H, Lq, Lk), True, 0.0, causal, scale=scale)[:2]
        if lse.shape != (B, H, _round_up(Lq, LSE_ALIGN)):
            raise RuntimeError(f"cp flash backend: the efficient kernel returned a log-sum-exp of shape "
                               f"{tuple(lse.shape)}, expected {(B, H, _round_up(Lq, LSE_ALIGN))}; use backend='math'")
        lse = lse[..., :Lq]
    if lse.shape != (B, H, Lq) or lse.dtype != torch.float32:
        raise RuntimeError(f"cp flash backend: the {kernel} kernel returned a log-sum-exp of shape "
                           f"{tuple(lse.shape)} ({lse.dtype}), expected {(B, H, Lq)} float32; use backend='math'")
    return out[..., :D], lse


def backward(dout, q, k, v, out, lse, causal: bool, mask, scale: float, ops: Ops | None = None):
    """``(dq, dk, dv)`` in the operands' dtype of one batch, given the merged ``out`` and ``lse`` ([B, H, Lq]) of
    its rows (pad rows: zero ``dout`` and ``out``, so they add nothing)."""
    ops = ops or ATEN
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    kernel = _checked(q, k, causal, mask)
    qp, kp, vp, dop, op = (_pad_dim(x) for x in (q, k, v, dout.to(q.dtype), out.to(q.dtype)))
    lse = lse.to(torch.float32)
    if kernel == "flash":
        # dropout 0: never read; the forward's shapes and dtype, left uninitialised (torch has few uint64 CUDA kernels)
        rng = torch.empty(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = ops.flash_bwd(dop.contiguous(), qp, kp, vp, op.contiguous(), lse.contiguous(), None, None, Lq, Lk,
                                   0.0, causal, rng, unused, scale=scale)[:3]
    else:
        padded = torch.full((B, H, _round_up(Lq, LSE_ALIGN)), math.inf, dtype=torch.float32, device=q.device)
        padded[..., :Lq] = lse
        seed = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout 0: never read
        offset = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = ops.efficient_bwd(dop.contiguous(), qp, _expand_heads(kp, H), _expand_heads(vp, H),
                                       _bias(mask, B, H, Lq, Lk), op.contiguous(), padded, seed, offset, 0.0,
                                       [True, True, True, False], causal, scale=scale)[:3]
        dk, dv = _fold_heads(dk, Hkv), _fold_heads(dv, Hkv)
    return dq[..., :D], dk[..., :D], dv[..., :D]


def _checked(q, k, causal: bool, mask) -> str:
    """The kernel for this batch, after the checks that name bad operands in one line."""
    why = unsupported(q.dtype)
    if why is not None:
        raise ValueError(f"cp flash backend on {q.device.type}: {why}; use backend='math'")
    if causal and q.shape[2] != k.shape[2]:
        # the two kernels align a non-square causal block differently (lower-right, upper-left); segment tasks never
        # make one
        raise ValueError(f"cp flash backend: a causal batch must be square, got {q.shape[2]} queries and "
                         f"{k.shape[2]} keys")
    return kernel_for(q.dtype, q.shape[-1], mask is not None)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _padded_dim(d: int) -> int:
    return _round_up(d, HEAD_DIM_STEP)


def _pad_dim(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its last dimension zero-padded to a multiple of ``HEAD_DIM_STEP`` (``x`` itself where it is one)."""
    d = x.shape[-1]
    return x if d % HEAD_DIM_STEP == 0 else torch.nn.functional.pad(x, (0, _padded_dim(d) - d))


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, H_kv, L, D]`` -> ``[B, heads, L, D]``: kv head ``j`` serves query heads ``j g .. j g + g - 1``."""
    g = heads // x.shape[1]
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _fold_heads(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of ``_expand_heads``: ``[B, H, L, D]`` -> ``[B, kv_heads, L, D]``, each kv head's query heads
    summed (in float32 or better, then rounded once)."""
    B, H, L, D = x.shape
    if kv_heads == H:
        return x
    work = torch.promote_types(x.dtype, torch.float32)
    return x.to(work).view(B, kv_heads, H // kv_heads, L, D).sum(2).to(x.dtype)


def _bias(mask, B: int, H: int, Lq: int, Lk: int):
    """The efficient kernel's ``attn_bias`` of an additive mask (``None``: no bias): a key mask ``[B, 1, 1, Lk]``
    or a band mask ``[1, 1, Lq, Lk]`` (``kernels.band_mask``).  Its rows start every ``BIAS_ALIGN`` elements of a
    fresh buffer (aligned strides and pointer), expanded to ``[B, H, Lq, Lk]`` (zero strides over the sizes of 1:
    no copy per head, query or band batch member)."""
    if mask is None:
        return None
    rows = mask.new_zeros((mask.shape[0], 1, mask.shape[2], _round_up(Lk, BIAS_ALIGN)))
    rows[..., :Lk] = mask
    return rows[..., :Lk].expand(B, H, Lq, Lk)
