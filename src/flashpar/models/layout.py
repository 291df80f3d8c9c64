"""How each parameter of ``ParallelLlama`` is split: ONE table, read by loading, checkpoints, gradient sums,
ZeRO-3 and ``flashpar train --check``.

``LAYOUT`` is keyed by the parameter's module name (the name before ``.weight``:
``blocks.3.qkv.weight`` -> ``qkv``).  With ``rows_t`` = ``shard_rows(R, tp, t)`` (``flashpar.rows``),
tp rank ``t`` of ``tp`` holds:

    kind          tp rank t holds                                     gradient summed over     ZeRO-3 rows
    FusedRows     cat_p W_p[rows_t]   (q, k, v  or  gate, up)         dp x cp x ulysses of t   yes
                  cat_p b_p[rows_t]   (their biases)                  dp x cp x ulysses of t   no
    Columns       W[:, cols_t]        (o_proj, down)                  dp x cp x ulysses of t   yes
    VocabRows     W[vrows_t]          (embedding, head: vocabulary)   dp x cp x ulysses of t   yes
    Replicated    W                   (norms, q/k norms, o/down bias) the whole mesh           no

(``vrows_t``: the vocabulary padded to a multiple of tp, ``VocabRows``.)

A fused parameter stacks, per tp rank, its rows of several single-process parameters
(``blocks.3.qkv.weight`` holds rows of ``blocks.3.q_proj.weight``, ``k_proj`` and ``v_proj``), so one
all-gather feeds all of them.  With ZeRO-3 each rank of the shard group (the dp x cp x ulysses ranks of its tp
index, which hold the same tp shard) keeps only its rows ``shard_rows(R_t, N, s)`` of every tp-split
parameter (``flashpar.models.zero``), so its gradient needs no sum beyond the ZeRO-3 reduce-scatter.  The
norm gains stay whole on every rank (a few thousand elements each).  ``label`` names the parameter's row of
``--check``'s table.

Under Ulysses (``ulysses > 1``, then ``tp = 1``: both split the attention heads) the attention projections are
whole weights (``ulysses_whole``): the GEMM fused with the all-to-all (``flashpar.overlap.a2a``) computes every
head group's projection of the rank's tokens, so it needs all of the weight; without ZeRO-3 every rank holds
them whole, with it their rows are split over the shard group like every other weight and gathered whole
before use.  The q/k/v weight stays ``cat(q, k, v)``; the model regroups it by head group on the fly.

Each kind gives the index ranges of the single-process tensors a rank holds (``pieces``: blocks of rows,
and of columns for ``Columns``, stacked along dim 0), with ZeRO-3 the dp rows composed in: dp rank
``d`` keeps rows ``[a, b) = shard_rows(R_t, dp, d)`` of the stacked tp shard, which ``pieces`` maps
back to sub-ranges of the parts::

    fused q/k/v of tp rank t (R_t = q_t + k_t + v_t rows stacked), dp = 3:
        stacked:   | q[rows_t]                | k[rows_t]  | v[rows_t]  |
        dp rows:   | d = 0          | d = 1             | d = 2        |
        d = 1 reads two pieces: the last rows of q[rows_t] and the first rows of k[rows_t]

``ParallelLlama.shard_of`` (from full tensors: loading, checkpoints) and ``ParallelLlama.load_hf_slices``
(a Hugging Face folder, each rank reading only these ranges: ``flashpar.models.hf``) both cut with
``pieces``, so they cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flashpar.models.config import LlamaConfig
from flashpar.models.zero import ZeroColumnParallelLinear, ZeroRowParallelLinear
from flashpar.overlap.modules import ColumnParallelLinear, RowParallelLinear
from flashpar.rows import shard_rows

Gather = Callable[[torch.Tensor, int], torch.Tensor]  # all-gather over tp, concatenated along a dim


@dataclass(frozen=True)
class Piece:
    """Rows ``[rows[0], rows[1])`` (and columns ``cols``, or all of them) of the ``part``-th single-process
    tensor of a parameter."""

    part: int
    rows: tuple[int, int]
    cols: tuple[int, int] | None = None

    def index(self) -> tuple[slice, ...]:
        """The index of the block (``tensor[piece.index()]``; a safetensors slice takes the same)."""
        rows = slice(*self.rows)
        return (rows,) if self.cols is None else (rows, slice(*self.cols))

    def clipped(self, rows: int) -> Piece:
        """The piece within a tensor of ``rows`` rows (a padded vocabulary's piece may reach past them)."""
        return Piece(self.part, (min(self.rows[0], rows), min(self.rows[1], rows)), self.cols)

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """The block of ``full``; rows past its end are zeros (``VocabRows``' padding)."""
        return padded(full[self.clipped(full.shape[0]).index()], self.rows[1] - self.rows[0])


def padded(block: torch.Tensor, rows: int) -> torch.Tensor:
    """``block`` with zero rows appended up to ``rows``."""
    if block.shape[0] >= rows:
        return block
    return torch.cat([block, block.new_zeros(rows - block.shape[0], *block.shape[1:])])


def stack(pieces: list[Piece], fetch: Callable[[Piece], torch.Tensor]) -> torch.Tensor:
    """A rank's parameter from its pieces (``fetch``: a piece's block), stacked along dim 0."""
    blocks = [fetch(piece) for piece in pieces]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def zero_pieces(pieces: list[Piece], d: int, n: int) -> list[Piece]:
    """The sub-pieces of dp rank ``d`` of ``n``: rows ``shard_rows(R, n, d)`` of the ``R`` rows that ``pieces``
    stack (empty intersections dropped; an empty share keeps one empty piece)."""
    a, b = shard_rows(sum(p.rows[1] - p.rows[0] for p in pieces), n, d)
    out, start = [], 0
    for p in pieces:
        lo, hi = p.rows
        x, y = max(a, start), min(b, start + hi - lo)  # this piece's stacked rows [start, start + hi - lo)
        if x < y:
            out.append(Piece(p.part, (lo + x - start, lo + y - start), p.cols))
        start += hi - lo
    return out or [Piece(pieces[0].part, (pieces[0].rows[0],) * 2, pieces[0].cols)]


@dataclass(frozen=True)
class Replicated:
    """Every rank holds the whole parameter."""

    label: str
    tp_dim = None  # the dim split over tp (every tp-split parameter is split by rows over the shard group)
    # an attention projection: under Ulysses a whole weight (the all-to-all's GEMM needs all of it)
    ulysses_whole: bool = field(default=False, kw_only=True)
    leaf: str = field(default="weight", kw_only=True)  # the parameter's name in its module ("weight", "bias")
    of: tuple[str, ...] = field(default=(), kw_only=True)  # the single-process modules (): the key itself
    zero: bool = field(default=True, kw_only=True)  # ZeRO-3 may split its rows (a tp-split weight)

    def parts(self, key: str) -> tuple[str, ...]:
        """The single-process modules this parameter is made of."""
        return self.of or (key,)

    @property
    def decays(self) -> bool:
        """Whether AdamW decays it: the tp-split weights (not the norm gains, not the biases)."""
        return self.tp_dim is not None and self.leaf == "weight"

    def tp_pieces(self, shapes: list[tuple[int, ...]], t: int, n: int) -> list[Piece]:
        """What tp rank ``t`` of ``n`` holds of the single-process tensors of ``parts`` (their ``shapes``)."""
        return [Piece(0, (0, shapes[0][0]))]

    def pieces(self, shapes: list[tuple[int, ...]], t: int, n: int, dp: tuple[int, int] | None = None) -> list[Piece]:
        """``tp_pieces``; with ``dp = (s, N)`` (ZeRO-3 rows: ``zero_rows``) only shard rank ``s``'s rows of them."""
        pieces = self.tp_pieces([tuple(s) for s in shapes], t, n)
        return pieces if dp is None else zero_pieces(pieces, *dp)

    def shard(self, full: list[torch.Tensor], t: int, n: int) -> torch.Tensor:
        """Tp rank ``t``'s part, from the single-process tensors of ``parts``."""
        return stack(self.tp_pieces([w.shape for w in full], t, n), lambda p: p.of(full[p.part]))

    def unshard(self, local: torch.Tensor, gather: Gather, cfg: LlamaConfig, n: int) -> list[torch.Tensor]:
        """The single-process tensors of ``parts`` from every tp rank's ``local`` (the inverse of ``shard``)."""
        return [local.detach().clone()]

    def zero_rows(self, zero3: bool) -> bool:
        """Whether a rank keeps only its ZeRO-3 rows of the tp shard (``zero3``: ZeRO-3 over a shard group of
        more than one rank): every tp-split weight (a bias is small and stays whole on its tp rank)."""
        return zero3 and self.zero and self.tp_dim is not None

    def grad_sum(self, zero3: bool) -> str:
        """The ranks that hold a copy, over which the gradient is summed: ``copy`` (the whole mesh),
        ``shard`` (the dp x cp x ulysses ranks of this tp index) or ``zero`` (ZeRO-3 rows, held by this rank
        alone: the reduce-scatter over the shard group summed them, nothing is left to sum)."""
        if self.tp_dim is None:
            return "copy"
        return "zero" if self.zero_rows(zero3) else "shard"


@dataclass(frozen=True)
class Rows(Replicated):
    """Tp rank ``t`` holds the rows ``shard_rows(R, tp, t)``."""

    tp_dim = 0

    def tp_pieces(self, shapes, t, n):
        return [Piece(0, shard_rows(shapes[0][0], n, t))]

    def unshard(self, local, gather, cfg, n):
        return [gather(local, 0)]


@dataclass(frozen=True)
class VocabRows(Rows):
    """The vocabulary (embedding, head) padded to ``Vp = ceil(V / tp) tp`` rows: tp rank ``t`` holds the rows
    ``[t Vp / tp, (t + 1) Vp / tp)``, those past ``V`` zeros (no token looks them up, their logits are masked:
    ``flashpar.models.vocab``); the single-process tensors stay ``[V, h]``, as Megatron pads::

        V = 5, tp = 2:   rank 0 | 0 1 2 |   rank 1 | 3 4 pad |
    """

    def tp_pieces(self, shapes, t, n):
        per = padded_vocab(shapes[0][0], n) // n
        return [Piece(0, (t * per, (t + 1) * per))]

    def unshard(self, local, gather, cfg, n):
        return [gather(local, 0)[: cfg.vocab_size]]


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp``: the parallel model's embedding and head rows."""
    return -(-vocab // tp) * tp


@dataclass(frozen=True)
class Columns(Replicated):
    """Tp rank ``t`` holds the columns ``shard_rows(C, tp, t)`` (a row-parallel linear's input features)."""

    tp_dim = 1

    def tp_pieces(self, shapes, t, n):
        return [Piece(0, (0, shapes[0][0]), shard_rows(shapes[0][1], n, t))]

    def unshard(self, local, gather, cfg, n):
        return [gather(local, 1)]

    def linear(self, zero3: bool) -> type:
        return ZeroRowParallelLinear if zero3 else RowParallelLinear


@dataclass(frozen=True)
class FusedRows(Replicated):
    """Tp rank ``t`` holds ``cat_p W_p[shard_rows(R_p, tp, t)]`` over the parts ``names``, whose full row
    counts are ``rows(cfg)``."""

    names: tuple[str, ...]
    rows: Callable[[LlamaConfig], tuple[int, ...]]
    tp_dim = 0

    def parts(self, key):
        return self.names

    def tp_pieces(self, shapes, t, n):
        return [Piece(p, shard_rows(shape[0], n, t)) for p, shape in enumerate(shapes)]

    def unshard(self, local, gather, cfg, n):
        pieces = local.split([r // n for r in self.rows(cfg)])  # the layer has divisible rows (checked there)
        return [gather(piece, 0) for piece in pieces]

    def linear(self, zero3: bool) -> type:
        return ZeroColumnParallelLinear if zero3 else ColumnParallelLinear


def _qkv_rows(c: LlamaConfig) -> tuple[int, ...]:
    return c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim


def _ffn_rows(c: LlamaConfig) -> tuple[int, ...]:
    return c.ffn, c.ffn


# The biases follow their weights' rows (q/k/v by head, gate/up by FFN row) and are kept whole on their tp rank
# under ZeRO-3; the output biases (o_proj, down) are added once after the reduce-scatter, so every rank holds them
# whole, like the norms.  The q/k norms' weight is per head_dim, shared by the heads: whole on every rank.
LAYOUT: dict[str, Replicated] = {  # in the order of --check's rows
    "embed": VocabRows("embedding"),
    "attn_norm": Replicated("attention norm"),
    "qkv": FusedRows("q/k/v", ("q_proj", "k_proj", "v_proj"), _qkv_rows, ulysses_whole=True),
    "qkv_bias": FusedRows("q/k/v bias", ("q_proj", "k_proj", "v_proj"), _qkv_rows, ulysses_whole=True, leaf="bias",
                          zero=False),
    "q_norm": Replicated("q norm"),
    "k_norm": Replicated("k norm"),
    "o_proj": Columns("attention out", ulysses_whole=True),
    "o_bias": Replicated("attention out bias", of=("o_proj",), leaf="bias"),
    "mlp_norm": Replicated("mlp norm"),
    "gate_up": FusedRows("gate/up", ("gate", "up"), _ffn_rows),
    "gate_up_bias": FusedRows("gate/up bias", ("gate", "up"), _ffn_rows, leaf="bias", zero=False),
    "down": Columns("mlp down"),
    "down_bias": Replicated("mlp down bias", of=("down",), leaf="bias"),
    "norm": Replicated("final norm"),
    "head": VocabRows("head"),
}


_OWNER = {(part, layout.leaf): key for key, layout in LAYOUT.items() for part in layout.parts(key)}  # q_proj -> qkv


def _split(name: str) -> tuple[str, str, str]:
    """``blocks.3.qkv.weight`` -> (``blocks.3.``, ``qkv``, ``weight``)."""
    *path, leaf = name.split(".")
    if not path:
        raise KeyError(f"parameter {name!r} has no module name")
    return "".join(p + "." for p in path[:-1]), path[-1], leaf


def layout_of(name: str) -> tuple[Replicated, list[str]]:
    """The layout of mesh parameter ``name`` and the single-process parameter names it is made of
    (``blocks.3.qkv_bias.bias`` -> ``blocks.3.{q,k,v}_proj.bias``)."""
    prefix, key, leaf = _split(name)
    if key not in LAYOUT:
        raise KeyError(f"parameter {name!r}: {key!r} is not in flashpar.models.layout.LAYOUT")
    layout = LAYOUT[key]
    return layout, [f"{prefix}{part}.{layout.leaf}" for part in layout.parts(key)]


def mesh_name(full_name: str) -> str:
    """The mesh parameter that holds single-process parameter ``full_name`` (``blocks.3.k_proj.weight`` ->
    ``blocks.3.qkv.weight``, ``blocks.3.k_proj.bias`` -> ``blocks.3.qkv_bias.bias``)."""
    prefix, key, leaf = _split(full_name)
    if (key, leaf) not in _OWNER:
        raise KeyError(f"parameter {full_name!r}: {key!r} is not in flashpar.models.layout.LAYOUT")
    owner = _OWNER[(key, leaf)]
    return f"{prefix}{owner}.{LAYOUT[owner].leaf}"


def label_of(full_name: str) -> str:
    """``--check``'s row for single-process parameter ``full_name`` (``blocks.3.k_proj.weight`` -> q/k/v)."""
    return LAYOUT[_split(mesh_name(full_name))[1]].label
