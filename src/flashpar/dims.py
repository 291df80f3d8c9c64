"""``ParallelDims``: the sizes of the ``(dp, cp, ulysses, tp)`` mesh, the rules between them and a model, and the
mesh they build; read by the trainer's config checks, the parallel model, the simulator's layouts and ``bench train``.

Ranks are numbered ``((d cp + c) U + u) tp + t`` (tp innermost), the order of ``DIMS``::

    dims (dp 2, cp 2, ulysses 1, tp 2):   rank  0 1 | 2 3 | 4 5 | 6 7
                                          d     0 0   0 0   1 1   1 1
                                          c     0 0   1 1   0 0   1 1
                                          t     0 1   0 1   0 1   0 1

The rules (each a one-line problem, ``None`` where there is none):

- every size an integer >= 1 (``ValueError`` when made);
- Ulysses and tensor parallelism both split the attention heads: ``ulysses > 1`` needs ``tp = 1``;
- the ``ring`` overlap mode does not apply to Ulysses' all-to-alls;
- ``tp`` divides the model's heads, kv heads and FFN (any vocabulary: the parallel model pads its rows to a multiple
  of tp, ``flashpar.models.layout.VocabRows``); ``ulysses`` splits its heads (``head_layout``);
- a packed sequence has at least two tokens per rank of a cp rank's group (``seq_len >= 2 cp ulysses tp``: head and
  tail of each).

The groups a rank belongs to: its ``tp`` group (the heads and FFN columns), its ``cp`` group (the K/V exchange), its
``ulysses`` group, and the shard group of ZeRO-3 (the ``dp x cp x ulysses`` ranks of its tp index, ``shard_size``).
"""

from __future__ import annotations

import dataclasses

DIMS = ("dp", "cp", "ulysses", "tp")
"""The mesh's dims, outermost first."""


def head_layout(heads: int, kv_heads: int, n: int) -> tuple[int, int]:
    """(query heads, kv heads) of each of ``n`` Ulysses ranks; a clear ``ValueError`` for layouts Ulysses cannot
    split.  Rank ``g`` attends with query heads ``[g H / n, (g + 1) H / n)``; ``kv_heads >= n`` gives it
    ``kv_heads / n`` of them (``kv_heads`` divisible by ``n``), ``kv_heads < n`` replicates each kv head on
    ``n / kv_heads`` ranks (one each), the only layout in which every rank holds the kv head its query heads
    read."""
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"heads = {heads} must be a positive multiple of kv_heads = {kv_heads}")
    if heads % n:
        raise ValueError(f"heads = {heads} is not divisible by the sequence-parallel size {n}")
    if kv_heads >= n and kv_heads % n:
        raise ValueError(f"kv_heads = {kv_heads} is not divisible by the sequence-parallel size {n}")
    if kv_heads < n and n % kv_heads:
        raise ValueError(f"kv_heads = {kv_heads} < {n} ranks must divide {n} (each kv head replicated on "
                         f"{n} / kv_heads ranks)")
    return heads // n, max(kv_heads // n, 1)


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    cp: int = 1
    ulysses: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in DIMS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")

    @classmethod
    def of_mesh(cls, mesh) -> ParallelDims:
        """The sizes of a device mesh with dims ``DIMS`` (a mesh without ``"ulysses"``: ``ulysses = 1``)."""
        names = mesh.mesh_dim_names or ()
        return cls(**{name: mesh[name].size() if name in names else 1 for name in DIMS})

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.ulysses * self.tp

    @property
    def shard_size(self) -> int:
        """The ZeRO-3 shard group: the ``dp x cp x ulysses`` ranks that hold one tp shard."""
        return self.dp * self.cp * self.ulysses

    @property
    def seq_ranks(self) -> int:
        """The ranks one packed sequence is split over: ``cp x ulysses x tp``."""
        return self.cp * self.ulysses * self.tp

    def stride(self, dim: str) -> int:
        """Ranks between two neighbours of a ``dim`` group: the product of the dims inside it."""
        out = 1
        for name in reversed(DIMS):
            if name == dim:
                return out
            out *= getattr(self, name)
        raise ValueError(f"unknown mesh dim {dim!r}")

    def label(self) -> str:
        return f"dp{self.dp} cp{self.cp} u{self.ulysses} tp{self.tp}"

    def group_ranks(self, dims: tuple[str, ...], rank: int = 0) -> list[int]:
        """The global ranks of ``rank``'s group over mesh dims ``dims``: those that share its other coordinates, in
        the group's order (row-major over its dims, as :meth:`mesh`'s sub-meshes and their process groups)."""
        coords, rest = {}, rank
        for d in reversed(DIMS):
            coords[d], rest = rest % getattr(self, d), rest // getattr(self, d)
        ranks = [0]
        for d in DIMS:
            stride, n = self.stride(d), getattr(self, d)
            ranks = [r + i * stride for r in ranks for i in range(n)] if d in dims else \
                [r + coords[d] * stride for r in ranks]
        return ranks

    def nodes_spanned(self, ranks_per_node: int) -> dict[str, int]:
        """Per mesh dim, the most nodes of ``ranks_per_node`` consecutive global ranks (torchrun's placement: node
        ``n`` holds ranks ``n L .. (n + 1) L - 1``) that one of its groups spans.  The mesh is row-major with tp
        innermost, so tp (and ulysses) groups are runs of neighbouring ranks and stay inside a node whenever their
        size divides the node's ranks; cp and dp stride over them::

            2 nodes x 4 ranks, dp 2 x cp 2 x tp 2:   node 0: ranks 0 1 2 3   node 1: ranks 4 5 6 7
                                                     tp [0, 1] -> 1 node, cp [0, 2] -> 1 node, dp [0, 4] -> 2 nodes
        """
        out = {}
        for d in DIMS:  # each group once: from its member whose coordinate along d is 0
            firsts = (r for r in range(self.world_size) if (r // self.stride(d)) % getattr(self, d) == 0)
            out[d] = max(len({m // ranks_per_node for m in self.group_ranks((d,), r)}) for r in firsts)
        return out

    def node_problem(self, ranks_per_node: int) -> str | None:
        """One line when tp or ulysses would span nodes (their all-gathers, reduce-scatters and all-to-alls run once
        per GEMM: on the link between nodes they cost several times NVLink's), else None."""
        if ranks_per_node >= self.world_size:
            return None
        spanned = self.nodes_spanned(ranks_per_node)
        bad = [d for d in ("ulysses", "tp") if spanned[d] > 1]
        if not bad:
            return None
        inner = self.ulysses * self.tp
        return (f"{' and '.join(bad)} would span nodes: {ranks_per_node} ranks per node (LOCAL_WORLD_SIZE) and ulysses "
                f"x tp = {inner}, which must divide it to keep tp and ulysses inside a node (choose a mesh with "
                f"ulysses x tp dividing {ranks_per_node}, or --allow-cross-node-tp to run it anyway)")

    def heads_problem(self) -> str | None:
        if self.ulysses > 1 and self.tp > 1:
            return (f"ulysses = {self.ulysses} and tp = {self.tp} both > 1 is not supported: Ulysses and tensor "
                    "parallelism both split the attention heads (compose --ulysses with --dp and --cp, --tp 1)")
        return None

    def mode_problem(self, mode: str) -> str | None:
        if self.ulysses > 1 and mode == "ring":
            return ("mode ring does not apply to the Ulysses all-to-alls; with ulysses > 1 use flash, slice, none or "
                    "auto")
        return None

    def model_problem(self, model) -> str | None:
        """``model``: any object with ``heads``, ``kv_heads`` and ``ffn`` (``LlamaConfig``)."""
        for name, size in (("heads", model.heads), ("kv heads", model.kv_heads), ("FFN size", model.ffn)):
            if size % self.tp:
                return f"{name} = {size} is not divisible by tp = {self.tp}"
        if self.ulysses > 1:
            try:
                head_layout(model.heads, model.kv_heads, self.ulysses)
            except ValueError as err:
                return f"ulysses = {self.ulysses}: {err}"
        return None

    def seq_problem(self, seq_len: int) -> str | None:
        least = 2 * self.seq_ranks
        if seq_len < least:
            return (f"seq-len {seq_len} is too short for cp = {self.cp} x ulysses = {self.ulysses} x tp = {self.tp} "
                    f"(at least {least} tokens)")
        return None

    def problem(self, model=None, mode: str | None = None) -> str | None:
        """The first broken rule among the dims alone, the ``mode`` and the ``model`` (those given), or None."""
        return (self.heads_problem() or (self.mode_problem(mode) if mode is not None else None)
                or (self.model_problem(model) if model is not None else None))

    def check(self, model=None, mode: str | None = None, where: str = "") -> None:
        """:meth:`problem` as a ``ValueError`` (``where``: a prefix naming the caller)."""
        bad = self.problem(model, mode)
        if bad:
            raise ValueError(where + bad)

    def mesh(self, device_type: str):
        """The device mesh of these sizes, dims named ``DIMS`` (every rank calls it; the process group is up;
        ``flashpar.mesh``: every group flashpar makes)."""
        from flashpar.mesh import device_mesh

        return device_mesh(device_type, (self.dp, self.cp, self.ulysses, self.tp), DIMS)
