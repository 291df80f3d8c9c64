"""CPU stand-ins of torch's fused CUDA attention kernels, for running ``flashpar.cp.sdpa_cuda`` on the CPU.

Each takes the aten op's arguments and returns what the op returns (shapes, dtypes, layout of the log-sum-exp),
after asserting the checks the CUDA code makes or relies on (``flash_attn/flash_api.cpp``: ``mha_fwd`` /
``mha_bwd``; ``attention.cu``, ``attention_backward.cu``, ``mem_eff_attention/kernel_forward.h``), and computes in
float64 with the kernel's own masking semantics:

* FlashAttention-2 (``_scaled_dot_product_flash_attention`` and its backward): fp16 / bf16, head dim a multiple of 8
  up to 256, ``H % H_kv == 0`` (GQA), no mask, causal aligned lower-right (query ``i`` sees keys ``j <= i + Lk -
  Lq``), log-sum-exp ``[B, H, Lq]`` float32, which the backward reads as a contiguous tensor; the backward's
  ``cum_seq_q`` undefined (the dense kernel).
* memory-efficient (``_scaled_dot_product_efficient_attention`` and its backward): fp16 / bf16 / fp32, equal heads,
  head dim and bias strides aligned (8 elements for half, 4 for float), bias ``[B, H, Lq, Lk]`` of q's dtype with a
  contiguous last dimension, causal aligned upper-left (``j <= i``), log-sum-exp ``[B, H, ceil(Lq / 32) 32]`` float32
  whose columns past ``Lq`` are ``+inf`` (written by the forward; the backward reads them without a bound check, so
  the stand-in backward insists on them).

The arithmetic is the kernels' (softmax of ``scale q k^T + bias`` over the visible keys; the backward of the
docstring of ``flashpar.cp.kernels``), in float64, rounded once to the operands' dtype.
"""

from __future__ import annotations

import math

import torch

from flashpar.cp.sdpa_cuda import Ops

HALF = (torch.float16, torch.bfloat16)


def _visible(lq: int, lk: int, diagonal: int | None) -> torch.Tensor | None:
    """[Lq, Lk] bool of the keys each query sees under a causal mask ``j <= i + diagonal`` (None: every key)."""
    if diagonal is None:
        return None
    return torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + diagonal


def _scores(q, k, bias, diagonal, scale):
    g = q.shape[1] // k.shape[1]
    s = scale * (q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2))
    if bias is not None:
        s = s + bias.double()
    vis = _visible(q.shape[2], k.shape[2], diagonal)
    return s if vis is None else s.masked_fill(~vis, -math.inf)


def attend(q, k, v, bias, diagonal, scale):
    """float64 ``(out, lse)`` of ``[B, H, Lq, D]`` queries over ``[B, H_kv, Lk, D]`` keys (query head ``h`` reads kv
    head ``h // (H / H_kv)``)."""
    s = _scores(q, k, bias, diagonal, scale)
    lse = s.logsumexp(-1)
    g = q.shape[1] // k.shape[1]
    return torch.exp(s - lse.unsqueeze(-1)) @ v.double().repeat_interleave(g, 1), lse


def attend_backward(dout, q, k, v, out, lse, bias, diagonal, scale):
    """float64 ``(dq, dk, dv)`` given ``out`` and ``lse`` of the rows (dK, dV summed over each kv head's queries)."""
    s = _scores(q, k, bias, diagonal, scale)
    g = q.shape[1] // k.shape[1]
    p = torch.exp(s - lse.double().unsqueeze(-1))
    do, vv = dout.double(), v.double().repeat_interleave(g, 1)
    ds = p * (do @ vv.transpose(-1, -2) - (do * out.double()).sum(-1, keepdim=True))
    dq = scale * ds @ k.double().repeat_interleave(g, 1)
    fold = lambda x: x.unflatten(1, (k.shape[1], g)).sum(2)  # noqa: E731
    return dq, fold(scale * ds.transpose(-1, -2) @ q.double()), fold(p.transpose(-1, -2) @ do)


def _check_qkv(q, k, v, dtypes, same_heads: bool, align: int) -> None:
    B, H, Lq, D = q.shape
    assert q.dtype in dtypes, f"dtype {q.dtype}"
    assert k.dtype == v.dtype == q.dtype, "query, key and value must share a dtype"
    assert k.dim() == 4 and k.shape == v.shape and k.shape[0] == B and k.shape[3] == D, (q.shape, k.shape, v.shape)
    assert H % k.shape[1] == 0 and (not same_heads or k.shape[1] == H), f"heads {H} and {k.shape[1]}"
    assert D % align == 0, f"head dim {D} is not a multiple of {align}"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "last dimension must be contiguous"
    for x in (q, k, v):  # rows of the [B, L, H, D] layout the kernels index, 16-byte aligned
        assert x.stride(1) % align == 0 and x.stride(2) % align == 0 and x.storage_offset() % align == 0


def flash_fwd(q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
    _check_qkv(q, k, v, HALF, False, 8)
    assert q.shape[-1] <= 256 and dropout_p == 0 and not return_debug_mask
    Lq, Lk = q.shape[2], k.shape[2]
    out, lse = attend(q, k, v, None, Lk - Lq if is_causal else None, scale)  # lower-right
    return (out.to(q.dtype), lse.float(), None, None, Lq, Lk, torch.zeros(2, dtype=torch.uint64),
            torch.zeros((), dtype=torch.uint64), torch.empty(0, dtype=q.dtype))


def flash_bwd(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, rng, unused, *, scale):
    _check_qkv(q, k, v, HALF, False, 8)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    assert cum_q is None and cum_k is None, "an undefined cum_seq_q selects the dense kernel"
    assert (max_q, max_k, dropout_p) == (Lq, Lk, 0.0)
    assert dout.dtype == out.dtype == q.dtype and dout.shape == out.shape == q.shape
    assert dout.stride(-1) == out.stride(-1) == 1
    assert lse.dtype == torch.float32 and lse.shape == (B, H, Lq) and lse.is_contiguous(), "read by raw pointer"
    assert rng.shape == (2,) and rng.dtype == torch.uint64
    dq, dk, dv = attend_backward(dout, q, k, v, out, lse, None, Lk - Lq if is_causal else None, scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _check_bias(bias, q, k, align: int) -> None:
    if bias is None:
        return
    B, H, Lq, _ = q.shape
    assert bias.dtype == q.dtype, "invalid dtype for bias - should match query's dtype"
    assert bias.shape == (B, H, Lq, k.shape[2]), f"attn_bias: wrong shape {tuple(bias.shape)}"
    assert bias.stride(3) == 1, "attn_bias: last dimension must be contiguous"
    assert all(s % align == 0 for s in bias.stride()[:3]), f"attn_bias is not correctly aligned: {bias.stride()}"
    assert bias.storage_offset() % align == 0


def _align(dtype: torch.dtype) -> int:
    return 8 if dtype in HALF else 4  # 128-bit rows: kAlignmentQ


def efficient_fwd(q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale):
    _check_qkv(q, k, v, (*HALF, torch.float32), True, _align(q.dtype))
    _check_bias(attn_bias, q, k, _align(q.dtype))
    assert compute_log_sumexp and dropout_p == 0
    B, H, Lq, _ = q.shape
    out, lse = attend(q, k, v, attn_bias, 0 if is_causal else None, scale)  # upper-left
    padded = torch.full((B, H, -(-Lq // 32) * 32), math.inf, dtype=torch.float32)
    padded[..., :Lq] = lse
    return out.to(q.dtype), padded, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)


def efficient_bwd(dout, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal, *, scale):
    _check_qkv(q, k, v, (*HALF, torch.float32), True, _align(q.dtype))
    _check_bias(attn_bias, q, k, _align(q.dtype))
    B, H, Lq, _ = q.shape
    assert dout.dtype == out.dtype == q.dtype and dout.shape == out.shape == q.shape and dropout_p == 0
    assert list(grad_input_mask) == [True, True, True, False]
    assert lse.dtype == torch.float32 and lse.shape == (B, H, -(-Lq // 32) * 32), f"lse {tuple(lse.shape)}"
    assert bool((lse[..., Lq:] == math.inf).all()), "the columns past Lq must be +inf (read without a bound check)"
    dq, dk, dv = attend_backward(dout, q, k, v, out, lse[..., :Lq], attn_bias, 0 if is_causal else None, scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


STANDINS = Ops(flash_fwd, flash_bwd, efficient_fwd, efficient_bwd)


class Recorder:
    """``Ops`` that count the calls of each kernel and pass them to ``inner``."""

    def __init__(self, inner: Ops) -> None:
        self.counts = {"flash": 0, "efficient": 0}
        self.ops = Ops(self._wrap("flash", inner.flash_fwd), self._wrap("flash", inner.flash_bwd),
                       self._wrap("efficient", inner.efficient_fwd), self._wrap("efficient", inner.efficient_bwd))

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            self.counts[name] += 1
            return fn(*args, **kwargs)
        return call
