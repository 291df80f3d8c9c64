"""The ``torch_compile`` peers' blocks: every block ``torch.compile``d whole, after tensor parallelism and before
FSDP2, as torchtitan's ``apply_compile`` (per block, ``fullgraph=True``, inductor), for ``bench train`` and
``bench prefill``.

    embed (eager)  ->  RowwiseParallel output hook: reduce-scatter, async  ->  to_local()
                   ->  wait_tensor (autograd-aware; with tp > 1, before the first compiled block)
    block i        ->  one compiled graph: norms, the TP-SP redistributions, q/k/v, rope, SDPA per
                       (document, chunk), o_proj, the MLP (no graph break: ``fullgraph=True``)
    norm, head, loss (eager, ``loss_parallel``)

Why the wait.  With tp > 1 the embedding's output hook (torch's ``RowwiseParallel``) redistributes
``Partial -> Shard(1)`` with ``async_op=True`` and ``to_local()`` hands the first block an
``AsyncCollectiveTensor`` (ACT) whose autograd edge lives on the wrapper while its inner tensor has
``requires_grad=False``.  torch 2.13's AOT autograd resolves top-level ACT graph inputs before tracing
(``torch/_functorch/_aot_autograd/frontend_utils.py``, ``process_inputs``: ``flat_args[i] =
a.trigger_wait()``), which returns that inner tensor: the input is traced as not needing a gradient, the
compiled block's backward returns none for it, autograd materializes zeros as a plain tensor for the
embedding's ``Redistribute`` node, and its backward fails with ``AttributeError: 'Tensor' object has no
attribute '_local_tensor'`` (``_redistribute.py``, ``NestedRedistribute.forward``).  Where the producer is
not a ``Redistribute`` the gradient is dropped silently.  A single-process reproduction without any
collective and the evidence are in docs/bench-train.md ("torch.compile at tp > 1").  The later blocks'
inputs are the compiled blocks' plain outputs, so only the first block is exposed; with tp 1 the
embedding returns a plain tensor.

The peer waits on that tensor with ``torch.distributed._functional_collectives.wait_tensor`` in a forward hook
on the embedding: the op has an identity backward registered, so the result is a plain tensor that keeps the
gradient's path, and the wait is where the first block's norm would wait anyway (no extra copy, no change to
the collectives or to what is compiled).  Without tp the hook is not installed.
"""

from __future__ import annotations

import torch
from torch import nn


def wait_for_embedding(embed: nn.Module) -> None:
    """Replace the embedding's async-collective output by its awaited value, keeping the gradient's path
    (``wait_tensor``'s identity backward), so that the first compiled block gets a plain tensor input."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor, wait_tensor

    def waited(module, args, out):
        return wait_tensor(out) if isinstance(out, AsyncCollectiveTensor) else out

    embed.register_forward_hook(waited)


def compile_blocks(model: nn.Module, tp: int) -> None:
    """Every block of ``model.blocks`` replaced by its ``torch.compile(block, fullgraph=True)`` (one graph per
    block, inductor); with ``tp > 1`` the embedding's output awaited first (:func:`wait_for_embedding`)."""
    if tp > 1:
        wait_for_embedding(model.embed)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, fullgraph=True)
