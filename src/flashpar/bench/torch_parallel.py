"""The ``torch`` peer parallelized with torch's own APIs only, the way torchtitan parallelizes its Llama.

Mesh ``("dp", "cp", "tp")`` (``make_mesh``), one packed sequence per dp rank:

* tensor + sequence parallelism (``parallelize_module``; torchtitan's ``apply_tp`` plans): the
  embedding ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))`` (vocabulary rows,
  activations leave sharded on the sequence), every norm ``SequenceParallel()``, attention and MLP
  behind ``PrepareModuleInput(Shard(1) -> Replicate())`` (the all-gather of the sequence), q/k/v and
  gate/up ``ColwiseParallel()``, o_proj and down ``RowwiseParallel(output_layouts=Shard(1))`` (the
  reduce-scatter), the head ``ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
  use_local_output=False)`` and the loss under ``loss_parallel()`` (vocabulary-parallel cross-entropy:
  no rank gathers the logits);
* context parallelism: the per-document head-tail layout torch's load-balancer docstring draws
  (every document cut into ``2 cp`` chunks, cp rank ``r`` keeping chunks ``r`` and ``2 cp - 1 - r``:
  :class:`DocumentHeadTail`, torch's ``_LoadBalancer`` interface) applied by ``_context_parallel_shard``
  to tokens, labels and positions; in attention K and V are all-gathered over cp with the
  autograd-aware functional all-gather (backward: the reduce-scatter of their gradients) and each
  rank's queries attend through :func:`flashpar.bench.torch_attention.attend`: on CPU SDPA per
  (document, local chunk) against that document's earlier keys (lower-right causal), on CUDA
  FlexAttention's document-causal block mask or ``varlen_attn``.  The ``dense`` peer keeps torch
  2.13's ``_PerDocumentHeadTailLoadBalancer`` order (its index list cut into contiguous cp pieces,
  which leaves the ranks' causal pairs unequal) and one SDPA with the ``[S_loc, S]`` mask;
* FSDP2 (torchtitan's ``apply_fsdp``): ``fully_shard`` on the embedding, on every block and on
  ``[norm, head]`` (``reshard_after_forward=False`` for that last group, the default policy's
  choice: FSDP would gather it again right away), then on the root, over the flattened ``dp x cp``
  mesh (parameters are replicated over cp, so their gradients are summed over it), gradient
  division off (the loss is already divided by the global number of targets; on gloo, which has
  no PREMUL_SUM, with ``set_force_sum_reduction_for_comms``).

torch's own ``context_parallel`` is not used: its SDPA path handles a plain causal mask only
(no document mask; torchtitan takes FlexAttention for documents) and on CPU it fails with
"Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
strategy registered".  The all-gathered K/V is the same exchange torch's all-gather rotater makes.

    rank (dp d, cp c, tp t) holds, between blocks:   x[1, S/cp/tp rows of its cp chunks, hidden]
    attention in:   all-gather over tp  -> [1, S/cp, hidden]      (PrepareModuleInput)
    q, k, v:        its heads / tp       k, v all-gathered over cp -> [1, H_kv/tp, S, D]
    out:            reduce-scatter over tp -> [1, S/cp/tp, hidden]
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _LoadBalancer

from flashpar.bench.torch_attention import DocLayout, build_layout, head_tail_order
from flashpar.bench.torch_llama import TorchLlama
from flashpar.models.llama import IGNORE, document_positions


def make_mesh(dp: int, cp: int, tp: int, device_type: str):
    """The torch peer's ``("dp", "cp", "tp")`` mesh (``flashpar.mesh``: every group flashpar makes)."""
    from flashpar.mesh import device_mesh

    return device_mesh(device_type, (dp, cp, tp), ("dp", "cp", "tp"))


def apply_tp(model: TorchLlama, tp_mesh) -> None:
    """Tensor + sequence parallelism with torch's plans (torchtitan's ``apply_tp``, loss parallel on)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if model.cfg.tie_embeddings:
        raise ValueError("torch peer: tensor parallelism of a tied embedding and head is not supported "
                         "(torchtitan's Llama is untied); use an untied model")
    parallelize_module(model, tp_mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {
            "attn_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                       desired_input_layouts=(Replicate(), None, None, None)),
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate": ColwiseParallel(),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        })


def apply_fsdp(model: TorchLlama, dp_mesh) -> None:
    """FSDP2 as torchtitan's ``apply_fsdp`` with the default reshard policy (no pipeline parallelism)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    fully_shard(model.embed, mesh=dp_mesh, reshard_after_forward=True)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=True)
    fully_shard([model.norm, model.head], mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if dp_mesh.device_type == "cpu":  # gloo reduces with SUM only (no PREMUL_SUM / AVG)
                module.set_force_sum_reduction_for_comms(True)


def parallelize(model: TorchLlama, mesh, compile_blocks: bool = False) -> TorchLlama:
    """TP-SP over ``mesh["tp"]``, K/V all-gather over ``mesh["cp"]``, [torch.compile per block,] FSDP2 over
    ``dp x cp`` (each where > 1)."""
    dp, cp, tp = (mesh[name].size() for name in ("dp", "cp", "tp"))
    if tp > 1:
        apply_tp(model, mesh["tp"])
    if cp > 1:
        for block in model.blocks:
            block.attn.cp_group = mesh["cp"].get_group()
    if compile_blocks:
        from flashpar.bench.compiled_blocks import compile_blocks as compile_each

        compile_each(model, tp)
    if dp * cp > 1:
        apply_fsdp(model, mesh["dp", "cp"]._flatten("dp_cp") if dp > 1 and cp > 1 else mesh["dp" if dp > 1 else "cp"])
    return model


@dataclass
class Batch:
    """This rank's part of one packed sequence: ``tokens`` / ``labels [1, S_loc]``, ``positions [S_loc]`` (inside
    each document), ``layout`` (the attention's index lists and masks, :mod:`flashpar.bench.torch_attention`)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    layout: DocLayout


class DocumentHeadTail(_LoadBalancer):
    """torch's load-balancer interface with the per-document head-tail layout its docstring draws (every
    document's chunks ``r`` and ``2 cp - 1 - r`` on cp rank ``r``: ``torch_attention.head_tail_order``), for
    ``_context_parallel_shard``: indices ``[1, S]``; with ``restore`` their inverse."""

    def __init__(self, doc_lens: list[int], cp: int) -> None:
        self.order = head_tail_order(doc_lens, cp)

    def _generate_indices(self, restore: bool = False) -> torch.Tensor:
        if not restore:
            return self.order[None]
        inverse = torch.empty_like(self.order)
        inverse[self.order] = torch.arange(self.order.numel())
        return inverse[None]


def torch_order(doc_lens: list[int], cp: int) -> torch.Tensor:
    """torch 2.13's ``_PerDocumentHeadTailLoadBalancer`` order, which ``_context_parallel_shard`` cuts into
    contiguous cp pieces (the dense peer's layout; its cp ranks' causal pairs differ)."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _PerDocumentHeadTailLoadBalancer,
    )

    bad = [n for n in doc_lens if n % (2 * cp)]
    if bad:
        raise ValueError(f"torch's per-document head-tail layout needs every document a multiple of 2 cp = {2 * cp} "
                         f"tokens, got {bad[:4]}")
    return _PerDocumentHeadTailLoadBalancer([doc_lens], cp, "cpu")._generate_indices()[0]


def make_batch(tokens: torch.Tensor, labels: torch.Tensor, doc_lens: list[int], mesh, device,
               attention: str = "docs") -> Batch:
    """Shard one packed sequence (``tokens`` / ``labels [S]``) over cp with ``_context_parallel_shard`` and a load
    balancer (:class:`DocumentHeadTail`; torch's own class for the ``dense`` peer), and build the attention's
    index lists and masks once for the batch."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _context_parallel_shard
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _PerDocumentHeadTailLoadBalancer,
    )

    cp = mesh["cp"].size()
    positions = document_positions(doc_lens)
    order, rank = None, 0
    tok, lab, pos = tokens[None], labels[None], positions[None]
    if cp > 1:
        if attention == "dense":
            order = torch_order(doc_lens, cp)
            balancer = _PerDocumentHeadTailLoadBalancer([doc_lens], cp, "cpu")
        else:
            balancer = DocumentHeadTail(doc_lens, cp)
            order = balancer.order
        tok, lab, pos = _context_parallel_shard(mesh["cp"], [tok, lab, pos], (1, 1, 1), load_balancer=balancer)
        rank = mesh["cp"].get_local_rank()
    layout = build_layout(doc_lens, cp, rank, attention, device, order=order)
    return Batch(tok.to(device), lab.to(device), pos[0].to(device), layout)


def build(cfg, mesh, full, device, *, lr: float, compile_blocks: bool = False):
    """``(model, opt)``: the peer with ``full``'s weights (a single-process :class:`flashpar.models.Llama`),
    parallelized on ``mesh``, and AdamW with the trainer's hyper-parameters (``flashpar.train.step.build``).
    ``compile_blocks``: every block ``torch.compile``d after TP and before FSDP, as torchtitan's ``apply_compile``
    (per block: the blocks are alike, so one compiled graph serves them all)."""
    model = TorchLlama(cfg)
    model.load_full(full)
    model.to(device)
    parallelize(model, mesh, compile_blocks=compile_blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt


def forward_backward(model: TorchLlama, batch: Batch, count: float, tp: int) -> torch.Tensor:
    """Forward, the next-token loss of this rank's tokens divided by the global batch's ``count`` of targets
    (vocabulary-parallel under ``loss_parallel`` with tp), and backward.  Returns this rank's share of the loss
    (the shares of all ranks add up to the mean next-token loss: the loss is replicated over tp, so a tp
    rank's share is 1/tp of it)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel() if tp > 1 else contextlib.nullcontext():
        logits = model(batch.tokens, batch.positions, batch.layout)
        logits = logits.flatten(0, 1)
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()  # the loss in fp32 at least, as flashpar's
        loss = F.cross_entropy(logits, batch.labels.flatten(), ignore_index=IGNORE, reduction="sum") / max(count, 1.0)
        loss.backward()
    local = loss.to_local() if isinstance(loss, DTensor) else loss
    return local.detach() / tp


def train_step(model: TorchLlama, opt, batch: Batch, count: float, tp: int) -> torch.Tensor:
    loss = forward_backward(model, batch, count, tp)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss
