"""What one simulated training step is made of: the model, the layout on the cluster, the packed documents.

Every dp rank trains on ``batch`` packed sequences of ``seq`` tokens per step (``packs``: the document lengths
of the sequences; each simulated pack stands for all ``batch`` sequences of a rank, and the slowest pack sets
the step).  Sizes per rank, for one configuration (``flashpar.sim.peers``: the torch peers have no Ulysses,
their cp group is cp x U ranks)::

    cp_size = cp (x U for torch)        T_cp = batch seq / cp_size   rows of a cp rank (the plan's, on average)
    u       = U (1 for torch)           T_u  = T_cp / u              rows of a ulysses rank = the rows a tp op
                                                                     gathers
    heads   = H / tp or H / U           kv_heads = H_kv / tp or max(H_kv / U, 1)   (flashpar.dims.head_layout)

Which side runs its blocks' elementwise regions compiled (``flashpar_compiled``, ``torch_compiled``; both by
default, the GPU presets' comparison): flashpar's compiled figures are those of ``flashpar train --compile``;
``flashpar.sim.elementwise`` counts each side's kernels either way.

What the run recomputes in backward: nothing; every block's forward (``checkpoint_activations``, full activation
checkpointing); or what torchtitan's per-op selective checkpointing recomputes (``selective``,
``flashpar.sim.step.selective_recompute``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from flashpar.cost import Hardware
from flashpar.cp.cost import BWD_ATTN_TIME  # a GPU preset's backward attention; a calibrated CPU run measures its own
from flashpar.models.config import LlamaConfig
from flashpar.options import ParallelOptions
from flashpar.sim.peers import Peer
from flashpar.sim.topology import Cluster, Layout


@dataclass(frozen=True)
class Workload:
    cfg: LlamaConfig
    layout: Layout
    cluster: Cluster
    packs: tuple[tuple[int, ...], ...]
    elem_bytes: int = 2  # activations and GEMMs (bf16); master weights, gradient sums and AdamW state fp32
    checkpoint_activations: bool = False  # each block recomputed in backward (full activation checkpointing)
    selective: bool = False  # torchtitan's per-op selective checkpointing instead (``step.selective_recompute``)
    batch: int = 1  # sequences per dp rank and step (torchtitan's local batch size)
    flashpar_compiled: bool = True  # flashpar's and baseline's blocks with ``flashpar train --compile``: their
    #                                 elementwise regions fused by inductor; False: its eager kernels
    #                                 (``flashpar.sim.elementwise``)
    torch_compiled: bool = True  # the torch peers' model under torch.compile; False: torchtitan's eager kernels
    prefetch: int = 1  # flashpar's ZeRO-3: units gathered ahead (``--prefetch``, 0: blocking; ``flashpar.sim.zero``)
    zero_collective: str = "auto"  # flashpar's ZeRO-3 units: "ring", "doubling" or "auto" (``zero.zero_collective``)
    fsdp_root: bool = False  # torch's FSDP2 wraps the embedding, final norm and head as one root unit
    torch_attention: str = "flex"  # the torch peer's kernel: "flex" (document blocks only), "docs" (SDPA per document
    #                                chunk, its masked rectangle: step.chunk_calls) or "dense" (S_loc x S)
    attn_bwd: tuple[float, float] | None = None  # (attn_peak, attn_half) of the backward kernel; None: BWD_ATTN_TIME
    zero_rs_elem_bytes: int = 4  # the ZeRO-3 / FSDP gradient reduce-scatter's element (fp32 sums)
    fsdp_prefetch: bool = True  # FSDP2 all-gathers the next block while this one computes
    fsdp_keep_last: bool = True  # FSDP2 keeps the last block gathered for backward (torchtitan's default policy)
    regather: bool = False  # flashpar / baseline (`--regather`): ag_matmul gathers x again in backward
    gather_vocab: bool = True  # flashpar / baseline gather a vocabulary smaller than T_u (models.vocab.gathers_weight)
    plan_hardware: Hardware | None = None  # the device figures the trainer planned with; None: the cp group's
    plan_per_step: bool = True  # planned per training step (CostModel.per_step; False: forward alone)
    plan_burst: float = 1.0  # CostModel.burst the trainer planned with (ranks sharing cores; a device per rank: 1)
    shared_cores: float = 1.0  # CostModel.burst of the run itself: > 1 where its ranks share a host's cores (the
    #                            bench's CPU box), and a block's compute ends as the cp ranks' computes share them

    def __post_init__(self) -> None:
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch must be a positive integer, got {self.batch!r}")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"--prefetch must be an integer >= 0, got {self.prefetch!r}")
        if self.zero_collective not in ("auto", "ring", "doubling"):
            raise ValueError(f"zero_collective must be auto, ring or doubling, got {self.zero_collective!r}")
        if self.checkpoint_activations and self.selective:
            raise ValueError("full and selective activation checkpointing exclude each other")

    @classmethod
    def of(cls, cfg: LlamaConfig, layout: Layout, cluster: Cluster, packs, options: ParallelOptions,
           **others) -> Workload:
        """The workload of a model run with ``options`` (``flashpar.options.ParallelOptions``: dtype, activation
        checkpointing, regather, vocabulary gather, ZeRO-3 prefetch and collective, torch.compile of the blocks'
        elementwise regions; options without a ``compile`` field run eager), ``others`` the simulator's own
        fields."""
        others.setdefault("flashpar_compiled", bool(getattr(options, "compile", False)))
        return cls(cfg, layout, cluster, packs, elem_bytes=options.dtype_bytes,
                   checkpoint_activations=options.checkpoint_activations, regather=options.regather,
                   gather_vocab=options.gather_vocab, prefetch=options.prefetch,
                   zero_collective=options.zero_collective, **others)

    @property
    def seq(self) -> int:
        return sum(self.packs[0])

    def sizes(self, peer: Peer) -> dict:
        """The per-rank sizes of ``peer`` on this layout (the module docstring's table)."""
        from flashpar.dims import head_layout

        L, cfg = self.layout, self.cfg
        u = L.ulysses if peer.ulysses else 1
        cp_size = L.cp * (1 if peer.ulysses else L.ulysses)
        if u > 1:
            heads, kv_heads = head_layout(cfg.heads, cfg.kv_heads, u)
        else:
            heads, kv_heads = cfg.heads // L.tp, max(cfg.kv_heads // L.tp, 1)
        t_cp = self.batch * self.seq / cp_size
        return {"u": u, "cp_size": cp_size, "tp": L.tp, "heads": heads, "kv_heads": kv_heads, "t_cp": t_cp,
                "t_u": t_cp / u, "split": L.tp * u}

    def groups(self, peer: Peer) -> dict[str, tuple[int, Hardware, str]]:
        """(size, hardware, link kind) of every group ``peer`` communicates over (``Cluster.group``)."""
        g = self.cluster.group
        L = self.layout
        cp_dims = ("cp",) if peer.ulysses else ("cp", "ulysses")
        return {"tp": g(L, ("tp",)), "ulysses": g(L, ("ulysses",)) if peer.ulysses else g(L, ()),
                "cp": g(L, cp_dims), "dp": g(L, ("dp",)), "shard": g(L, ("dp", "cp", "ulysses")),
                "all": g(L, ("dp", "cp", "ulysses", "tp"))}

    def bwd_hardware(self, hw: Hardware) -> Hardware:
        """``hw`` with the backward attention kernel's curve."""
        if self.attn_bwd is not None:
            return dataclasses.replace(hw, attn_peak=self.attn_bwd[0], attn_half=self.attn_bwd[1])
        return dataclasses.replace(hw, attn_peak=hw.attn_peak / BWD_ATTN_TIME)

    @functools.cached_property
    def keys_per_token(self) -> float:
        """Mean keys a query attends to under the causal document mask (the MFU's attention term)."""
        pairs = sum(n * (n + 1) // 2 for p in self.packs for n in p)
        return pairs / sum(sum(p) for p in self.packs)
