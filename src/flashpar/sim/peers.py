"""The three configurations of ``flashpar bench train``, as the simulator runs them: one table, read by
``flashpar.sim.step`` (time), ``flashpar.sim.memory`` (bytes) and ``flashpar.sim.check_train``.

    name      linears (tp, ulysses)      data parallel                 context parallel
    flashpar  FlashOverlap "flash"       ZeRO-3 over dp, fused (flash)  flashcp plans, K/V sharding-aware, p2p,
                                                                        local first (cp.attention)
    baseline  mode "none" (blocking)     ZeRO-3 over dp, blocking       per_doc plans (all K/V), same executor
    torch     DTensor TP-SP: blocking    FSDP2 per block over dp x cp,  torch's per-document head-tail layout,
              (= mode "none")            prefetched one block ahead     K/V all-gathered (blocking) over cp x U

flashpar and baseline sum the gradients of what is not ZeRO-split (tp shards over dp x cp x U without ZeRO,
ZeRO rows over cp x U, embedding / head over dp x cp x U) with all-reduces posted during backward
(``flashpar.models.grad_sync``); torch's FSDP2 reduce-scatters every block's gradients over dp x cp x U.  The
torch peer has no Ulysses: its context-parallel group is cp x U ranks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    name: str
    mode: str  # FlashOverlap mode of the tp / ulysses / ZeRO-3 ops ("flash" or "none")
    strategy: str  # CP planner strategy
    data_parallel: str  # "zero3" (flashpar.models.zero, dp only) or "fsdp" (FSDP2 over dp x cp x U)
    kv: str  # "plan": cp.attention's exchange of the plan, overlapped; "allgather": blocking all-gather
    ulysses: bool  # whether the mesh's ulysses dim runs Ulysses (else it joins cp)


PEERS = {
    "flashpar": Peer("flashpar", "flash", "flashcp", "zero3", "plan", True),
    "baseline": Peer("baseline", "none", "per_doc", "zero3", "plan", True),
    # torch's per-document head-tail layout: per_doc's placement (the same chunks r and 2 cp - 1 - r of every
    # document where lengths are multiples of 2 cp, as bench train packs them; the planner's torch_per_doc
    # reproduces torch's own class, whose import costs seconds)
    "torch": Peer("torch", "none", "per_doc", "fsdp", "allgather", False),
}
NAMES = tuple(PEERS)
