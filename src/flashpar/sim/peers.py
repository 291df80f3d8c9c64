"""The configurations the simulator runs: one table, read by ``flashpar.sim.step`` and ``flashpar.sim.zero``
(time), ``flashpar.sim.memory`` (bytes) and ``flashpar.sim.check_train``.  The first three are ``flashpar
bench train``'s; ``torch_async_tp`` is simulated only (it needs torch.compile and symmetric memory on GPUs).

    name            linears (tp, ulysses)      data parallel                  context parallel
    flashpar        FlashOverlap "flash"       ZeRO-3 over S, auto per block  flashcp plans, K/V sharding-aware,
                                               (prefetch / fused)             p2p, local first (cp.attention)
    baseline        mode "none" (blocking)     ZeRO-3 over S, blocking        per_doc plans (all K/V), same
                                                                              executor
    torch           DTensor TP-SP: blocking    FSDP2 per block over S,        torch's per-document head-tail
                    (= mode "none")            prefetched one block ahead     layout, K/V all-gathered
                                                                              (blocking) over cp x U
    torch_async_tp  torch's async TP: "flash"  as torch                       as torch

``S`` = dp x cp x U, the shard group (``flashpar.sim.zero``).  The torch peers have no Ulysses: their
context-parallel group is cp x U ranks.

torch_async_tp is torchtitan's ``enable_async_tensor_parallel`` (inductor's micro-pipeline TP:
``torch.distributed._symmetric_memory``'s ``_fused_all_gather_matmul`` / ``_fused_matmul_reduce_scatter``).
The all-gather + matmul copies the local shard first and consumes it, then pulls each peer's shard in turn
(rank + 1, + 2, ...) with the copy engine and multiplies it as it lands; the matmul + reduce-scatter computes
the chunk of each peer in turn, the local one last, and writes it into that peer's buffer, then sums what it
received.  That is FlashOverlap's ``flash`` schedule (point-to-point per peer, local first for the gather,
local last for the reduce-scatter, one GEMM piece per peer), not ``ring`` (neighbour forwarding) nor
``slice`` (chunked collectives); so the peer runs mode flash with one chunk, forward and backward (the
compiled backward graph holds the same patterns).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    name: str
    mode: str  # FlashOverlap mode of the tp / ulysses / ZeRO-3 ops ("flash" or "none")
    strategy: str  # CP planner strategy
    data_parallel: str  # "zero3" (flashpar's ZeRO-3) or "fsdp" (FSDP2); both over S (flashpar.sim.zero)
    kv: str  # "plan": cp.attention's exchange of the plan, overlapped; "allgather": blocking all-gather
    ulysses: bool  # whether the mesh's ulysses dim runs Ulysses (else it joins cp)


PEERS = {
    "flashpar": Peer("flashpar", "flash", "flashcp", "zero3", "plan", True),
    "baseline": Peer("baseline", "none", "per_doc", "zero3", "plan", True),
    # torch's per-document head-tail layout: per_doc's placement (the same chunks r and 2 cp - 1 - r of every
    # document where lengths are multiples of 2 cp, as bench train packs them; the planner's torch_per_doc
    # reproduces torch's own class, whose import costs seconds)
    "torch": Peer("torch", "none", "per_doc", "fsdp", "allgather", False),
    "torch_async_tp": Peer("torch_async_tp", "flash", "per_doc", "fsdp", "allgather", False),
}
NAMES = tuple(PEERS)


def is_torch(peer: Peer) -> bool:
    """Whether ``peer`` is one of the torch configurations (FSDP2 + DTensor TP)."""
    return peer.data_parallel == "fsdp"
