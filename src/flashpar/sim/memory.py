"""Memory per GPU of one configuration on a layout: weights, gradients, AdamW state, activations, buffers.

Parameters a rank holds (``P_local``; flashpar's one parameter table, ``flashpar.models.layout``):

    flashpar, baseline   block projections / tp (Ulysses: attention projections whole, the MLP whole), ZeRO-3
                         rows / dp of every tp-split projection when dp > 1; norms whole; embedding and head:
                         vocabulary / tp (not split over dp)
    torch                everything / tp / (dp x cp x U)                    (FSDP2 over dp x cp x U)

    weights    4 P_local        fp32 master weights
    grads      4 P_local        fp32 gradients
    optimizer  8 P_local        AdamW's two fp32 moments
    buffers    flashpar: the largest gathered tp-shard weight in the compute dtype and its fp32 gradient before
               the reduce-scatter (ZeRO-3), else its compute-dtype copy; torch: two unsharded blocks (the one
               computing and the one prefetched) and one block's fp32 gradient before its reduce-scatter

Activations saved for backward, per block, per token of the cp rank (``T_cp``), elements of the compute
dtype (``r = tp x U`` ranks split a cp rank's rows between the blocks and its heads inside them)::

    4 h / r                the block input, the two norm outputs, the mid residual (sequence-parallel rows)
    + 2 h (tp - 1) / tp    the two norm outputs all-gathered for q/k/v and gate/up, kept for backward (tp > 1,
                           unless the linear gathers again: ``--regather``, ZeRO-3; ``step.gathers_again``)
    (H_r + 2 H_kv,r) D     q, k, v after rope (every token of the cp rank, the rank's heads)
    H_r D                  the attention output
    4 F / r                gate, up, silu(gate), their product
    + the received K/V     2 H_kv,r D per key received from other cp ranks (the plan's, kept for backward)

torch's TP saves the all-gathered norm outputs too; its attention keeps the all-gathered K/V of the whole
sequence.  The head's input adds ``T_u h`` once where it is kept gathered (``T_u h / tp``, its rows, where
it is gathered again), or, where the weights are gathered instead (``step.gathers_vocab``), ``T_u h / tp`` and the
gathered fp32 weights.  With activation checkpointing a block keeps only its input
(``h / r`` per token) and one block's activations exist at a time (the one being recomputed).  The loss adds
the rank's logits ``T_u x vocab / tp`` (compute dtype, and fp32 softmax and gradient).

A layout fits when the total is at most ``USABLE`` of the GPU's memory (the rest: CUDA context, NCCL buffers,
allocator fragmentation).
"""

from __future__ import annotations

from flashpar.sim.peers import Peer
from flashpar.sim.step import gathers_again, gathers_vocab, head_gathers_again
from flashpar.sim.workload import Workload

GPU_MEMORY_GB = {"h100-nvlink": 80.0, "h100-ib": 80.0, "h200": 141.0, "a100": 80.0, "b200": 180.0}
"""HBM per GPU of each preset (datasheets: H100 SXM 80 GB, H200 141 GB, A100 SXM 80 GB, HGX B200 180 GB)."""
USABLE = 0.9


def local_params(w: Workload, peer: Peer) -> float:
    cfg, s, L = w.cfg, w.sizes(peer), w.layout
    h, d = cfg.hidden, cfg.head_dim
    attn = h * (cfg.heads + 2 * cfg.kv_heads) * d + cfg.heads * d * h
    mlp = 3 * h * cfg.ffn
    tables = cfg.vocab_size * h * (1 if cfg.tie_embeddings else 2)
    if peer.data_parallel == "fsdp":
        return cfg.params / s["tp"] / (L.dp * L.cp * L.ulysses)
    zero = L.dp if L.dp > 1 else 1
    block = attn + mlp / zero if s["u"] > 1 else (attn + mlp) / s["tp"] / zero
    return cfg.layers * (block + 2 * h) + tables / s["tp"] + h


def activations(w: Workload, peer: Peer, kv_recv_tokens: float) -> float:
    """Bytes of activations at the peak (the loss, every block's saved tensors in place)."""
    cfg, s = w.cfg, w.sizes(peer)
    h, d, r, t = cfg.hidden, cfg.head_dim, s["split"], s["t_cp"]
    attn = (s["heads"] + 2 * s["kv_heads"]) * d + s["heads"] * d
    mlp = 4 * cfg.ffn / r
    kept = s["tp"] > 1 and not gathers_again(w, peer)  # the gathered inputs of q/k/v, gate/up (and the head)
    rows = 4 * h / r + (2 * h * (s["tp"] - 1) / s["tp"] if kept else 0.0)
    kv = 2 * s["kv_heads"] * d * kv_recv_tokens
    one_block = (t * (rows + attn + mlp) + kv) * w.elem_bytes
    blocks = cfg.layers * t * h / r * w.elem_bytes + one_block if w.checkpoint else cfg.layers * one_block
    logits = s["t_u"] * cfg.vocab_size / s["tp"] * (w.elem_bytes + 8)
    if gathers_vocab(w, peer):  # the own rows' input, and the gathered fp32 weights (tied: one)
        weights = (1 if cfg.tie_embeddings else 2) * cfg.vocab_size * h * 4
        return blocks + s["t_u"] * h / s["tp"] * w.elem_bytes + weights + logits
    head_kept = s["tp"] > 1 and not head_gathers_again(w, peer)
    head_in = s["t_u"] * h / (1 if head_kept else s["tp"]) * w.elem_bytes  # gathered T_u x h, or the own rows
    return blocks + head_in + logits


def buffers(w: Workload, peer: Peer) -> float:
    cfg, s, L = w.cfg, w.sizes(peer), w.layout
    h, d = cfg.hidden, cfg.head_dim
    if peer.data_parallel == "fsdp":
        unit = cfg.block_matmul_params / s["tp"]
        return unit * (2 * w.elem_bytes + w.zero_rs_elem_bytes)
    largest = max(h * (cfg.heads + 2 * cfg.kv_heads) * d, 2 * h * cfg.ffn) / s["tp"]
    if L.dp > 1:
        return largest * (w.elem_bytes + w.zero_rs_elem_bytes)
    return largest * w.elem_bytes


def memory(w: Workload, peer: Peer, kv_recv_tokens: float) -> dict[str, float]:
    """GB per GPU: ``weights``, ``grads``, ``optimizer``, ``activations``, ``buffers`` and their ``total``."""
    p = local_params(w, peer)
    out = {"weights": 4 * p, "grads": 4 * p, "optimizer": 8 * p, "activations": activations(w, peer, kv_recv_tokens),
           "buffers": buffers(w, peer)}
    out = {k: v / 1e9 for k, v in out.items()}
    out["total"] = sum(out.values())
    return out
