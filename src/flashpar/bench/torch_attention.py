"""The torch peer's document-causal attention over context-parallel chunks, one batch's index lists built once.

Per-document head-tail layout (torch's load-balancer docstring): every document of ``n_d`` tokens is cut
into ``2 cp`` chunks of ``L_d = n_d / (2 cp)``; cp rank ``r`` keeps chunk ``r`` (its head) and chunk
``2 cp - 1 - r`` (its tail) of every document, in document order::

    document d:   | c0 | c1 | c2 | c3 |        cp = 2
    rank 0 holds: c0 c3 (of d), then c0 c3 of d + 1, ...     (causal pairs L(1 + 4) L per document)
    rank 1 holds: c1 c2 (of d), ...                           (causal pairs L(2 + 3) L: the same)

The cp group's K/V arrive all-gathered in rank order (``gather_cp``); ``restore [S]`` puts them back in
the sequence's order (the gathered position of every original position).  A query chunk at original
positions ``[a, a + L)`` of a document starting at ``s`` attends to the keys ``[s, a + L)``: a
lower-right causal mask ``[L, a + L - s]`` (query ``i`` sees keys ``j <= i + a - s``).

Kernels (``kind``):

    "docs"    SDPA per (document, local chunk) against that document's earlier keys: square chunks
              ``is_causal``, others with their lower-right mask (built once per batch).  torch's CPU
              flash kernel visits every key block it is given, so giving it one document's keys is
              what makes it document-sparse on CPU.
    "dense"   one SDPA of all local queries against all ``S`` keys with the ``[S_loc, S]``
              document-causal mask (every pair computed; the peer before this layout).
    "flex"    FlexAttention with a document-causal ``BlockMask`` over (local queries, gathered keys):
              only the blocks holding allowed pairs are computed (compiled on CUDA).
    "varlen"  ``torch.nn.attention.varlen.varlen_attn`` over the (document, chunk) sequences:
              queries ``cu_q`` (local chunks), keys ``cu_k`` (each chunk's ``[s, a + L)`` of the
              restored K/V, copied by ``key_index``), causal aligned lower right (``window (-1, 0)``).
              CUDA only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

KINDS = ("docs", "dense", "flex", "varlen")


def head_tail_order(doc_lens: list[int], cp: int) -> torch.Tensor:
    """Original position of every position of the gathered order (rank 0's tokens, then rank 1's, ...)."""
    bad = [n for n in doc_lens if n % (2 * cp)]
    if bad:
        raise ValueError(f"the per-document head-tail layout needs every document a multiple of 2 cp = {2 * cp} "
                         f"tokens, got {bad[:4]}")
    starts = [sum(doc_lens[:i]) for i in range(len(doc_lens))]
    ranks = []
    for r in range(cp):
        pieces = []
        for s, n in zip(starts, doc_lens, strict=True):
            chunk = n // (2 * cp)
            pieces += [torch.arange(s + r * chunk, s + (r + 1) * chunk),
                       torch.arange(s + (2 * cp - 1 - r) * chunk, s + (2 * cp - r) * chunk)]
        ranks.append(torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long))
    return torch.cat(ranks)


@dataclass
class Chunk:
    """A run of local queries ``[q0, q1)`` at original positions ``[a, a + q1 - q0)`` in the document starting at
    ``s``; its keys are the restored ``[s, a + q1 - q0)``."""

    q0: int
    q1: int
    s: int
    a: int
    mask: torch.Tensor | None = None  # [L, a + L - s] lower-right causal; None when square (is_causal)


@dataclass
class DocLayout:
    """One rank's view of one packed sequence: ``order [S]`` (original position of each gathered position),
    ``mine [S_loc]`` (this rank's slice of it), ``restore [S]`` (gathered position of each original position;
    None without cp), ``chunks`` (runs of local queries, in local order), and the kernel's own tables."""

    kind: str
    order: torch.Tensor
    mine: torch.Tensor
    restore: torch.Tensor | None
    chunks: list[Chunk]
    mask: torch.Tensor | None = None  # "dense": [S_loc, S] over the gathered keys
    extra: dict = field(default_factory=dict)  # "flex": block_mask; "varlen": cu_q, cu_k, key_index, max_q, max_k


def chunks_of(doc_lens: list[int], mine: torch.Tensor, cp: int = 1) -> list[Chunk]:
    """Runs of consecutive original positions of one document in the local order ``mine``, cut at the
    document's chunk boundaries (every ``n_d / (2 cp)`` tokens) when ``cp > 1``: rank ``cp - 1``'s two chunks
    of a document are adjacent, and as two calls its kernel computes ``(2 cp + 1) L^2`` pairs where one
    ``2L x (cp + 1) L`` rectangle would be ``(2 cp + 2) L^2`` (``L^2 / 2`` of either are masked)."""
    bounds = torch.tensor(doc_lens).cumsum(0)
    doc = torch.bucketize(mine, bounds, right=True).tolist()
    pos = mine.tolist()
    starts = [0, *bounds.tolist()]
    chunk = [max(n // (2 * cp), 1) if cp > 1 else n for n in doc_lens]
    out, q0 = [], 0
    for i in range(1, len(pos) + 1):
        if (i == len(pos) or doc[i] != doc[q0] or pos[i] != pos[i - 1] + 1
                or (pos[i] - starts[doc[i]]) % chunk[doc[i]] == 0):
            out.append(Chunk(q0, i, starts[doc[q0]], pos[q0]))
            q0 = i
    return out


def lower_right(q: int, k: int, device=None) -> torch.Tensor:
    """``[q, k]``: query ``i`` sees key ``j`` where ``j <= i + k - q``."""
    return torch.ones(q, k, dtype=torch.bool, device=device).tril(k - q)


def build_layout(doc_lens: list[int], cp: int, rank: int, kind: str, device, order: torch.Tensor | None = None,
                 ) -> DocLayout:
    """Every index list and mask of ``kind`` for cp rank ``rank`` (once per batch, outside the step).  ``order``:
    the gathered order when not the head-tail one (the dense peer keeps torch's own balancer's order)."""
    if kind not in KINDS:
        raise ValueError(f"torch peer attention: expected one of {', '.join(KINDS)}, got {kind!r}")
    if order is None:
        order = head_tail_order(doc_lens, cp) if cp > 1 else torch.arange(sum(doc_lens))
    total = order.numel()
    if total % cp:
        raise ValueError(f"{total} tokens do not split over cp {cp}")
    mine = order.view(cp, -1)[rank]
    restore = None
    if cp > 1:
        restore = torch.empty_like(order)
        restore[order] = torch.arange(total)
    chunks = chunks_of(doc_lens, mine, cp)
    layout = DocLayout(kind, order, mine, restore.to(device) if restore is not None else None, chunks)
    if kind == "docs":
        for c in chunks:
            n, k = c.q1 - c.q0, c.a + c.q1 - c.q0 - c.s
            c.mask = None if n == k else lower_right(n, k, device)
    elif kind == "dense":
        doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
        layout.mask = ((doc[mine][:, None] == doc[order][None, :]) & (order[None, :] <= mine[:, None])).to(device)
    elif kind == "flex":
        layout.extra["block_mask"] = flex_block_mask(doc_lens, mine, order, device)
    else:
        layout.extra.update(varlen_tables(chunks, device))
    return layout


def flex_block_mask(doc_lens: list[int], mine: torch.Tensor, order: torch.Tensor, device):
    """FlexAttention's ``BlockMask`` of the local queries (original positions ``mine``) against the gathered keys
    (``order``): same document and not later.  Blocks of 128 (fewer where the sequence is shorter)."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens)).to(device)
    q_pos, k_pos = mine.to(device), order.to(device)

    def document_causal(b, h, q, kv):
        return (doc[q_pos[q]] == doc[k_pos[kv]]) & (k_pos[kv] <= q_pos[q])

    block = min(128, mine.numel(), order.numel())
    return create_block_mask(document_causal, None, None, mine.numel(), order.numel(), device=str(device),
                             BLOCK_SIZE=block)


def varlen_tables(chunks: list[Chunk], device) -> dict:
    """``cu_q`` / ``cu_k`` (int32 offsets of the query runs and of their key ranges), ``key_index`` (restored
    positions ``[s, a + L)`` of every chunk, concatenated), ``max_q`` / ``max_k``."""
    lens_q = [c.q1 - c.q0 for c in chunks]
    lens_k = [c.a + c.q1 - c.q0 - c.s for c in chunks]
    key_index = torch.cat([torch.arange(c.s, c.a + c.q1 - c.q0) for c in chunks]) if chunks else torch.zeros(0)
    cu = lambda lens: torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)  # noqa: E731
    return {"cu_q": cu(lens_q), "cu_k": cu(lens_k), "key_index": key_index.long().to(device),
            "max_q": max(lens_q, default=0), "max_k": max(lens_k, default=0)}


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: DocLayout) -> torch.Tensor:
    """Attention of the local queries ``q [1, H, S_loc, D]`` over the gathered keys / values ``k``, ``v
    [1, H_kv, S, D]`` (gathered order) in ``layout.kind``; ``[1, H, S_loc, D]``."""
    kind = layout.kind
    if kind == "dense":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask, enable_gqa=True)
    if kind == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=layout.extra["block_mask"], enable_gqa=True)
    if layout.restore is not None:  # the sequence's order: every document's keys contiguous
        k, v = k.index_select(2, layout.restore), v.index_select(2, layout.restore)
    if kind == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        t = layout.extra
        kk = k[0].transpose(0, 1).index_select(0, t["key_index"])  # [sum of key ranges, H_kv, D]
        vv = v[0].transpose(0, 1).index_select(0, t["key_index"])
        out = varlen_attn(q[0].transpose(0, 1), kk, vv, t["cu_q"], t["cu_k"], t["max_q"], t["max_k"],
                          window_size=(-1, 0), enable_gqa=True)
        return out.transpose(0, 1)[None]
    outs = []
    for c in layout.chunks:
        end = c.a + c.q1 - c.q0
        outs.append(F.scaled_dot_product_attention(q[:, :, c.q0:c.q1], k[:, :, c.s:end], v[:, :, c.s:end],
                                                   attn_mask=c.mask, is_causal=c.mask is None, enable_gqa=True))
    return torch.cat(outs, dim=2)
