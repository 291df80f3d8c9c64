"""The compute between a block's communicating ops, as functions of tensors: what ``--compile`` compiles.

A ``ParallelBlock`` alternates communicating ops (the overlapped linears, ZeRO-3's gathers, Ulysses'
all-to-alls, FlashCP's attention with its K/V exchange) with elementwise work.  The elementwise work is
cut at the communicating ops into five regions, each a function of tensors only::

    x ─ norm ─▶ [qkv linear] ─ heads ─▶ [cp.attention] ─▶ [o linear] ─ add_norm ─▶ [gate/up linear]
          ─ swiglu ─▶ [down linear] ─ add ─▶ x'

    norm      a = rms(x) w                                (the attention norm; the model's last norm)
    heads     q, k, v of qkv: + bias, per-head rms (qk-norm), rope on q and k
    add_norm  x' = x + (o + b_o);  m = rms(x') w_mlp       (the residual add and the MLP norm, one pass)
    swiglu    silu(g + b_g) (u + b_u) of gu = [g | u]
    add       x + (y + b_down)

and one in the loss (``flashpar.models.vocab.vocab_parallel_loss``), between its two all-reduces over tp::

    logits z ─ max ─▶ [all-reduce max] ─ loss_sums ─▶ [all-reduce sums] ─▶ log, the rows' sum
    loss_sums  sum_v exp(z_v - m) per row (no [T, V] tensor of exponentials), the target's logit

``EAGER`` runs them as flashpar always has (rope and SwiGLU as the hand-fused autograd nodes of
``flashpar.models.fused``; the norm's formula is ``flashpar.models.llama.rms_norm``, the single-process
model's).  ``compiled()`` is the same functions with rope and SwiGLU in plain ops, each given to
``torch.compile`` (inductor; ``fullgraph=True``: a graph break is an error, not a silent split).  The rows
of every activation are marked dynamic: the token count of a step changes with the CP plan, so a region
is compiled once for every token count, with the model's sizes, head counts and ``eps`` as constants.

The communicating ops are never traced: the block calls them between the regions in eager Python, so
their overlap schedule (the peer order, the lanes, the waits) is exactly eager's, and every block of the
model reuses the same five compiled regions (the loss its sixth).  Every input of a region is a tensor or
a value equal on every rank (head counts, ``eps``; the loss's rank-dependent vocabulary offset enters as
the targets' column indices, a tensor), so every rank compiles the same graphs.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashpar.models.fused import rope_qkv
from flashpar.models.fused import swiglu as fused_swiglu
from flashpar.models.llama import rms_norm

Tensor = torch.Tensor


def norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``rms_norm(x) weight`` in ``x``'s dtype (the norm computes in fp32 at least)."""
    return rms_norm(x, weight, eps).to(x.dtype)


def _biased(x: Tensor, bias: Tensor | None) -> Tensor:
    return x if bias is None else x + bias.to(x.dtype)


def _qk_normed(qkv: Tensor, q_w: Tensor | None, k_w: Tensor | None, heads: int, kv_heads: int, eps: float) -> Tensor:
    """``qkv [T, (heads + 2 kv_heads) D]`` with q and k normed per head (``q_w``, ``k_w``: qk-norm's gains; None:
    unchanged)."""
    if q_w is None:
        return qkv
    t, d = qkv.shape[0], qkv.shape[1] // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    q = rms_norm(q.reshape(t, heads, d), q_w, eps).to(qkv.dtype).reshape(t, heads * d)
    k = rms_norm(k.reshape(t, kv_heads, d), k_w, eps).to(qkv.dtype).reshape(t, kv_heads * d)
    return torch.cat([q, k, v], dim=1)


def heads_fused(qkv: Tensor, bias: Tensor | None, q_w: Tensor | None, k_w: Tensor | None, cos: Tensor,
                sin: Tensor, heads: int, kv_heads: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``q [T, heads, D]``, ``k``, ``v [T, kv_heads, D]`` of the q/k/v GEMM's output: bias, qk-norm, then rope
    (``cos``, ``sin [T, D / 2]``) as ``flashpar.models.fused.rope_qkv``'s one autograd node."""
    qkv = _qk_normed(_biased(qkv, bias), q_w, k_w, heads, kv_heads, eps)
    return rope_qkv(qkv, (cos, sin), heads, kv_heads)


def _rotate(x: Tensor, c: Tensor, s: Tensor) -> Tensor:
    """Rope's half-split rotation of ``x [T, n, D]`` (``c``, ``s [T, 1, D / 2]``): ``[x1 c - x2 s | x2 c + x1 s]``.
    The halves by ``chunk`` (and ``split`` in the callers), not by slicing: their gradient is one ``cat``, which
    inductor writes in one pass, where each slice's is a zero-filled tensor of the whole width to add up (measured
    on CPU at ``[4096, 512]``: the compiled backward 2.4 ms against 3.3 ms)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def heads_plain(qkv: Tensor, bias: Tensor | None, q_w: Tensor | None, k_w: Tensor | None, cos: Tensor,
                sin: Tensor, heads: int, kv_heads: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``heads_fused`` in plain ops, for a compiler to fuse (the same products and sums per element)."""
    qkv = _qk_normed(_biased(qkv, bias), q_w, k_w, heads, kv_heads, eps)
    t, d = qkv.shape[0], qkv.shape[1] // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    c, s = cos[:, None, :], sin[:, None, :]
    return _rotate(q.reshape(t, heads, d), c, s), _rotate(k.reshape(t, kv_heads, d), c, s), \
        v.reshape(t, kv_heads, d).contiguous()


def add_norm(x: Tensor, out: Tensor, bias: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(x', norm(x'))`` with ``x' = x + (out + bias)``: the attention's residual add and the MLP's norm."""
    x = x + _biased(out, bias)
    return x, norm(x, weight, eps)


def swiglu_fused(gu: Tensor, bias: Tensor | None) -> Tensor:
    """``silu(g) u`` of ``gu + bias = [g | u]`` (``flashpar.models.fused.swiglu``'s autograd node)."""
    return fused_swiglu(_biased(gu, bias))


def swiglu_plain(gu: Tensor, bias: Tensor | None) -> Tensor:
    """``swiglu_fused`` in plain ops (the halves by ``chunk``: see ``_rotate``; measured on CPU at ``[4096, 1408]``:
    the compiled backward 5.1 ms against 11.8 ms with slices, and 8.2 ms of the hand-fused node)."""
    g, u = _biased(gu, bias).chunk(2, dim=-1)
    return F.silu(g) * u


def add(x: Tensor, out: Tensor, bias: Tensor | None) -> Tensor:
    """``x + (out + bias)``: the MLP's residual add."""
    return x + _biased(out, bias)


def loss_sums(logits: Tensor, top: Tensor, index: Tensor, mine: Tensor) -> tuple[Tensor, Tensor]:
    """The loss's two sums over this rank's vocabulary columns (``flashpar.models.vocab.vocab_parallel_loss``), of
    fp32 ``logits [T, C]`` and the row maxima ``top [T]`` (all-reduced): ``sum_v exp(z_v - top)`` per row, and the
    target's logit (column ``index``) where the target is this rank's (``mine``), else 0."""
    total = torch.exp(logits - top.unsqueeze(-1)).sum(-1)
    # where, not a product: another rank's target may clamp onto a padded column (-inf x 0 is nan)
    picked = torch.where(mine, logits.gather(1, index.unsqueeze(-1)).squeeze(-1), 0.0)
    return total, picked


@dataclass(frozen=True)
class Regions:
    """One implementation of each region (see the module docstring)."""

    norm: Callable[..., Tensor]
    heads: Callable[..., tuple[Tensor, Tensor, Tensor]]
    add_norm: Callable[..., tuple[Tensor, Tensor]]
    swiglu: Callable[..., Tensor]
    add: Callable[..., Tensor]
    loss_sums: Callable[..., tuple[Tensor, Tensor]]
    compiled: bool


EAGER = Regions(norm, heads_fused, add_norm, swiglu_fused, add, loss_sums, compiled=False)
_COMPILED: list[Regions] = []


def compiled() -> Regions:
    """The regions given to ``torch.compile`` (made once per process, shared by every block and model)."""
    if not _COMPILED:
        import torch._dynamo
        import torch._inductor.config

        # a region recompiled past torch's limit would run eagerly without a word: raise instead (``run`` below
        # turns it into one line)
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
            # every rank of a node compiles its own regions at the same time (from inductor's cache when an
            # earlier run filled it): a pool of worker processes per rank would start cores x ranks of them
            torch._inductor.config.compile_threads = 1

        def make(fn, rows: tuple[int, ...]):
            compiled_fn = torch.compile(fn, fullgraph=True)

            @functools.wraps(fn)
            def run(*args):
                for i in rows:  # the token count: the one size that changes from step to step
                    torch._dynamo.mark_dynamic(args[i], 0)
                try:
                    return compiled_fn(*args)
                except torch._dynamo.exc.FailOnRecompileLimitHit as err:
                    raise RuntimeError(
                        f"--compile: the {fn.__name__!r} region was compiled "
                        f"{torch._dynamo.config.recompile_limit} times, torch._dynamo's recompile_limit, so it "
                        "would run eagerly from here; its inputs' types or shapes change from call to call "
                        "(run without --compile, or raise torch._dynamo.config.recompile_limit)") from err

            return run

        _COMPILED.append(Regions(make(norm, (0,)), make(heads_plain, (0, 4, 5)), make(add_norm, (0, 1)),
                                 make(swiglu_plain, (0,)), make(add, (0, 1)), make(loss_sums, (0, 1, 2, 3)),
                                 compiled=True))
    return _COMPILED[0]


def regions(compile: bool) -> Regions:
    """The compiled regions when ``compile``, else the eager ones."""
    return compiled() if compile else EAGER
