"""Memory per GPU of one configuration on a layout: weights, gradients, AdamW state, activations, buffers.

Parameters a rank holds (``P_local``, ``flashpar.sim.zero.local_params``; ``S`` the shard group, dp x cp x U
ranks with the same tp index)::

    flashpar, baseline   (L x block projections / tp + embedding and head tables / tp) / |S| + norms whole
                         (Ulysses, tp = 1: the projections whole before the split over S; |S| = 1: no split)
    torch                everything / tp / |S|                               (FSDP2 over dp x cp x U)

    weights    4 P_local        fp32 master weights
    grads      4 P_local        fp32 gradients
    optimizer  8 P_local        AdamW's two fp32 moments
    buffers    flashpar, baseline (ZeRO-3, ``P_unit`` = a block's projections / tp):
                 (K + 1) gathered units in the compute dtype (K = --prefetch; baseline 0) and one unit's
                 unsharded fp32 gradient before its reduce-scatter, where a block is prefetched; the largest
                 tp-shard weight gathered and its fp32 gradient, where every block is fused; plus the units
                 kept gathered from forward to backward: the head's table (tied: the one table) and the
                 last block when it is prefetched.  |S| = 1: the largest weight's compute-dtype copy
               torch (FSDP2): two gathered blocks (the one computing and the one prefetched), one block's
                 fp32 gradient, the kept last block and (norm, head) unit (``fsdp_root``: the root unit of
                 both tables)

Activations saved for backward, per block, per token of the cp rank (``T_cp``, all ``batch`` sequences),
elements of the compute dtype (``r = tp x U`` ranks split a cp rank's rows between the blocks and its heads
inside them)::

    4 h / r                the block input, the two norm outputs, the mid residual (sequence-parallel rows)
    + 2 h (tp - 1) / tp    the two norm outputs all-gathered for q/k/v and gate/up, kept for backward (tp > 1,
                           unless the linear gathers again: ``--regather``, a fused ZeRO-3 block;
                           ``step.gathers_again``); a prefetched block's linears are the plain tp op and keep it
    (H_r + 2 H_kv,r) D     q, k, v after rope (every token of the cp rank, the rank's heads)
    H_r D                  the attention output
    4 F / r                gate, up, silu(gate), their product
    + the received K/V     2 H_kv,r D per key received from other cp ranks (the plan's, kept for backward)

torch's TP saves the all-gathered norm outputs too; its attention keeps the all-gathered K/V of the whole
sequence.  The head's input adds ``T_u h`` once where it is kept gathered (``T_u h / tp``, its rows, where
it is gathered again), or, where the weights are gathered instead (``step.gathers_vocab``), ``T_u h / tp`` and the
gathered fp32 weights.  With activation checkpointing a block keeps only its input (``h / r`` per token) and
one block's activations exist at a time (the one being recomputed).  torchtitan's per-op selective
checkpointing (``Workload.selective``) keeps per token the block input ``h / r``, the saved GEMM outputs q
``H_r D``, v ``H_kv,r D``, w1 ``F / tp`` and w2 ``h`` (tp > 1: its partial sums over all rows), the attention
output ``H_r D`` and, with tp, the two reduce-scatters' outputs ``2 h / tp``; the block in backward holds a
whole block's activations again (what it recomputes and the gradients of what it kept), as with full
checkpointing.  The loss adds the rank's
logits ``T_u x vocab / tp`` (compute dtype, and fp32 softmax and gradient).

A layout fits when the total is at most ``USABLE`` of the GPU's memory (the rest: CUDA context, NCCL buffers,
allocator fragmentation).
"""

from __future__ import annotations

from flashpar.sim.peers import Peer
from flashpar.sim.step import gathers_again, gathers_vocab, head_gathers_again, is_torch
from flashpar.sim.workload import Workload
from flashpar.sim.zero import FUSED, PREFETCH, block_params, local_params, shard_size, table_params

__all__ = ["GPU_MEMORY_GB", "USABLE", "activations", "buffers", "local_params", "memory"]

GPU_MEMORY_GB = {"h100-nvlink": 80.0, "h100-ib": 80.0, "h100-96gb": 96.0, "h200": 141.0, "a100": 80.0, "b200": 180.0}
"""HBM per GPU of each preset (datasheets: H100 SXM 80 GB, H200 141 GB, A100 SXM 80 GB, HGX B200 180 GB; the
96 GB HBM2e H100 of torchtitan's published runs)."""
USABLE = 0.9


def _one_block(w: Workload, peer: Peer, kv_recv_tokens: float, fused: bool) -> float:
    """Bytes one block saves for backward without checkpointing."""
    cfg, s = w.cfg, w.sizes(peer)
    h, d, r, t = cfg.hidden, cfg.head_dim, s["split"], s["t_cp"]
    attn = (s["heads"] + 2 * s["kv_heads"]) * d + s["heads"] * d
    mlp = 4 * cfg.ffn / r
    kept = s["tp"] > 1 and not gathers_again(w, peer, fused)  # the gathered inputs of q/k/v, gate/up
    rows = 4 * h / r + (2 * h * (s["tp"] - 1) / s["tp"] if kept else 0.0)
    kv = 2 * s["kv_heads"] * d * kv_recv_tokens
    return (t * (rows + attn + mlp) + kv) * w.elem_bytes


def _selective_block(w: Workload, peer: Peer, kv_recv_tokens: float) -> float:
    """Bytes one block keeps under torchtitan's per-op selective checkpointing (the module docstring)."""
    cfg, s = w.cfg, w.sizes(peer)
    h, d, r, tp = cfg.hidden, cfg.head_dim, s["split"], s["tp"]
    per_token = h / r + 2 * s["heads"] * d + s["kv_heads"] * d + cfg.ffn / tp + h + (2 * h / tp if tp > 1 else 0)
    return (s["t_cp"] * per_token + 2 * s["kv_heads"] * d * kv_recv_tokens) * w.elem_bytes


def activations(w: Workload, peer: Peer, kv_recv_tokens: float, schedule: tuple[str, ...] | None = None) -> float:
    """Bytes of activations at the peak (the loss, every block's saved tensors in place); ``schedule``: the
    ZeRO-3 kind of each block (None: every block prefetched)."""
    cfg, s = w.cfg, w.sizes(peer)
    h, r = cfg.hidden, s["split"]
    schedule = schedule or (PREFETCH,) * cfg.layers
    per_kind = {k: _one_block(w, peer, kv_recv_tokens, k == FUSED) for k in set(schedule)}
    if w.checkpoint_activations:
        blocks = cfg.layers * s["t_cp"] * h / r * w.elem_bytes + max(per_kind.values())
    elif w.selective:  # what each block keeps, and the block in backward whole again (recomputed, its gradients)
        blocks = cfg.layers * _selective_block(w, peer, kv_recv_tokens) + max(per_kind.values())
    else:
        blocks = sum(per_kind[k] for k in schedule)
    logits = s["t_u"] * cfg.vocab_size / s["tp"] * (w.elem_bytes + 8)
    if gathers_vocab(w, peer):  # the own rows' input, and the gathered fp32 weights (tied: one)
        weights = (1 if cfg.tie_embeddings else 2) * cfg.vocab_size * h * 4
        return blocks + s["t_u"] * h / s["tp"] * w.elem_bytes + weights + logits
    head_kept = s["tp"] > 1 and not head_gathers_again(w, peer)
    head_in = s["t_u"] * h / (1 if head_kept else s["tp"]) * w.elem_bytes  # gathered T_u x h, or the own rows
    return blocks + head_in + logits


def buffers(w: Workload, peer: Peer, schedule: tuple[str, ...] | None = None) -> float:
    """Bytes of gathered weights and unsharded gradients at the peak (the module docstring)."""
    cfg, s = w.cfg, w.sizes(peer)
    h, d, e, g = cfg.hidden, cfg.head_dim, w.elem_bytes, w.zero_rs_elem_bytes
    unit, table = block_params(w, peer), table_params(w, peer)
    if is_torch(peer):
        kept = (2 * table + h if w.fsdp_root else table + h) + (unit if w.fsdp_keep_last else 0.0)
        return unit * (2 * e + g) + kept * e
    largest = max(h * (cfg.heads + 2 * cfg.kv_heads) * d, 2 * h * cfg.ffn) / s["tp"]
    if shard_size(w, peer) == 1:
        return largest * e
    schedule = schedule or (PREFETCH,) * cfg.layers
    ahead = w.prefetch if peer.mode != "none" else 0
    states = []
    if PREFETCH in schedule:
        states.append(unit * ((ahead + 1) * e + g))
    if FUSED in schedule:
        states.append(largest * (e + g))
    kept = table + (unit if schedule[-1] == PREFETCH else 0.0)
    return max(states) + kept * e


def memory(w: Workload, peer: Peer, kv_recv_tokens: float, schedule: tuple[str, ...] | None = None
           ) -> dict[str, float]:
    """GB per GPU: ``weights``, ``grads``, ``optimizer``, ``activations``, ``buffers`` and their ``total``."""
    p = local_params(w, peer)
    out = {"weights": 4 * p, "grads": 4 * p, "optimizer": 8 * p,
           "activations": activations(w, peer, kv_recv_tokens, schedule), "buffers": buffers(w, peer, schedule)}
    out = {k: v / 1e9 for k, v in out.items()}
    out["total"] = sum(out.values())
    return out
