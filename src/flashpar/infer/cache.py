"""The sharded KV cache: each rank keeps the K/V of the tokens its plan placed on it, for its heads.

A prompt's *group* is the cp ranks that hold any of its prefill tokens (one rank: a Whole-Doc prompt; several:
a split one).  Each decode step appends the new token's K/V to the group's rank with the fewest cached tokens
of that prompt (ties: the lowest cp rank).  That rule reads only counts every rank knows, so the whole schedule
of appends is fixed before decoding (``CacheSchedule``): every buffer is allocated once, at its final size,
and no step asks another rank where a token went.

Per rank and layer one buffer ``[slots, kv_heads_local, head_dim]`` each for K and V; prompt ``p``'s region is
``[offset_p, offset_p + capacity_p)`` with ``capacity_p`` = its prefill tokens here + its appends here + 1
spare slot (a rank that does not append at a step writes the new K/V into the first free slot, past the
valid length, where it is never read and a later append overwrites it; that keeps a step free of branches
on the host)::

    cp rank 1, prompts 0 (split over ranks 0, 1) and 2 (whole here), 2 appends of prompt 0 due here:
        slots   | p0: prefill 37..39 | app | app | spare | p2: prefill 0..16 | app ... | spare |
        valid   |<-- lens[0] ------->|                   |<-- lens[1] ------------->|

The prefill K/V of a prompt sit in its region in global token order.  ``lens`` (device) counts each row's
valid slots; ``append[step]`` (device, built once) says which rows append at a decode step; ``key_positions``
(device, built once) each slot's position in its prompt, which a layer's sliding window reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashpar.cp.cp_plan import CPPlan


@dataclass(frozen=True)
class CacheSchedule:
    """Where every token's K/V lives, the same on every rank: ``held[r][p]`` prefill tokens of prompt ``p`` on
    cp rank ``r``; ``appends[s][p]`` the cp rank that stores prompt ``p``'s K/V of decode step ``s``."""

    held: tuple[tuple[int, ...], ...]
    appends: tuple[tuple[int, ...], ...]

    def group(self, p: int) -> list[int]:
        """The cp ranks that hold part of prompt ``p``."""
        return [r for r, counts in enumerate(self.held) if counts[p] > 0]

    def split(self) -> list[int]:
        """The prompts held by more than one cp rank, ascending: the ones whose decode combines partials."""
        return [p for p in range(len(self.held[0])) if len(self.group(p)) > 1]


def cache_schedule(plan: CPPlan, steps: int) -> CacheSchedule:
    """The schedule of ``plan`` (one document per prompt) for ``steps`` decode steps."""
    n, lens = plan.cp_size, plan.doc_lens
    held = [torch.bincount(plan.doc_ids(r), minlength=len(lens)).tolist() for r in range(n)]
    count = [row[:] for row in held]
    groups = [[r for r in range(n) if held[r][p] > 0] for p in range(len(lens))]
    appends = []
    for _ in range(steps):
        step = []
        for p, group in enumerate(groups):
            r = min(group, key=lambda g, p=p: (count[g][p], g))
            count[r][p] += 1
            step.append(r)
        appends.append(tuple(step))
    return CacheSchedule(tuple(map(tuple, held)), tuple(appends))


class RankCache:
    """This rank's cache (cp rank ``rank`` of ``plan``; ``kv_heads`` its tp rank's kv heads), for
    ``layers`` layers and the decode steps of ``schedule``.

    ``rows``: the prompts this rank decodes (those it holds tokens of), ascending; row ``i`` of every decode
    tensor is prompt ``rows[i]``.  ``split_rows``: the rows of prompts split over several ranks, ``split_slots``:
    their indices among ``schedule.split()``."""

    def __init__(self, plan: CPPlan, schedule: CacheSchedule, rank: int, layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.plan, self.schedule, self.rank, self.device = plan, schedule, rank, device
        held = schedule.held[rank]
        self.rows = [p for p, c in enumerate(held) if c > 0]
        appended = [sum(step[p] == rank for step in schedule.appends) for p in self.rows]
        self.prefill_tokens = [held[p] for p in self.rows]
        capacity = [h + a + 1 for h, a in zip(self.prefill_tokens, appended, strict=True)]
        offsets = [sum(capacity[:i]) for i in range(len(capacity))]
        slots, width = sum(capacity), max(capacity, default=1)
        split = schedule.split()
        self.split_prompts = split
        mine = [(i, split.index(p)) for i, p in enumerate(self.rows) if p in split]
        self.split_rows = torch.tensor([i for i, _ in mine], dtype=torch.long, device=device)
        self.split_slots = torch.tensor([j for _, j in mine], dtype=torch.long, device=device)
        self.offsets = torch.tensor(offsets, dtype=torch.long, device=device)
        cap = torch.tensor(capacity, dtype=torch.long)
        col = torch.arange(width)
        # [rows, width]: a row's slots, the last one repeated past its capacity (masked: never valid)
        self.index = (torch.tensor(offsets, dtype=torch.long)[:, None] + torch.minimum(col, cap[:, None] - 1)
                      ).to(device)
        self.columns = col.to(device)
        self.lens = torch.tensor(self.prefill_tokens, dtype=torch.long, device=device)
        self.steps_done = 0
        self.append = torch.tensor([[step[p] == rank for p in self.rows] for step in schedule.appends],
                                   dtype=torch.bool, device=device).reshape(len(schedule.appends), len(self.rows))
        # prefill: local token j (the plan's local order) -> its slot (its prompt's region, global order).  A
        # prompt's tokens are contiguous in the sequence, so in global order each prompt's tokens here follow one
        # another: the k-th of them in that order goes to its region's slot k
        docs = plan.doc_ids(rank)
        order = torch.argsort(plan.local_indices(rank))  # local tokens in global order
        ranked = docs[order]
        counts = torch.tensor(held, dtype=torch.long)
        first = counts.cumsum(0) - counts  # where each prompt's tokens begin in that order
        region = torch.zeros(len(held), dtype=torch.long)
        region[torch.tensor(self.rows, dtype=torch.long)] = torch.tensor(offsets, dtype=torch.long)
        slot = torch.empty_like(docs)
        slot[order] = region[ranked] + torch.arange(docs.numel()) - first[ranked]
        self.prefill_slots = slot.to(device)
        # each slot's token position in its document (a sliding window reads it): a prefill token's own; the
        # append of decode step s holds position len(prompt) + s; spare slots are never valid (position 0)
        starts = torch.tensor(plan.doc_lens, dtype=torch.long).cumsum(0) - torch.tensor(plan.doc_lens)
        position = torch.zeros(slots, dtype=torch.long)
        position[slot] = plan.local_indices(rank).long() - starts[docs]
        for i, p in enumerate(self.rows):
            mine = [s for s, step in enumerate(schedule.appends) if step[p] == rank]
            at = offsets[i] + held[p] + torch.arange(len(mine), dtype=torch.long)
            position[at] = plan.doc_lens[p] + torch.tensor(mine, dtype=torch.long)
        self.key_positions = position[self.index.cpu()].to(device)  # [rows, width], built once
        self.k = [torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]

    # ---- prefill

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the prefill K/V ``[T_cp, kv_heads, D]`` of this rank's tokens (the plan's local order)."""
        self.k[layer].index_copy_(0, self.prefill_slots, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(0, self.prefill_slots, v.to(self.v[layer].dtype))

    def sink(self, layer: int):
        """The ``kv_sink`` of a prefill block: ``fill`` of ``layer``."""
        return lambda k, v: self.fill(layer, k, v)

    # ---- decode

    def write(self, layer: int, step: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new token's K/V ``[rows, kv_heads, D]`` of decode ``step`` into each row's first free slot (kept
        where the row appends at ``step``, a spare write elsewhere)."""
        at = self.offsets + self.lens
        self.k[layer].index_copy_(0, at, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(0, at, v.to(self.v[layer].dtype))

    def valid(self, step: int) -> torch.Tensor:
        """``[rows, width]``: which of each row's slots hold K/V at ``step`` (the new token's where it appends)."""
        return self.columns[None, :] < (self.lens + self.append[step])[:, None]

    def in_window(self, valid: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """``valid`` narrowed to the keys a query at ``positions [rows]`` sees through a sliding ``window`` (its
        ``window`` latest positions, its own included: ``q - k < window``); ``valid`` itself without one."""
        return valid if not window else valid & (positions[:, None] - self.key_positions < window)

    def keys(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every row's slots, ``[rows, width, kv_heads, D]`` each (mask with ``valid``)."""
        return self.k[layer][self.index], self.v[layer][self.index]

    def advance(self, step: int) -> None:
        """After every layer of ``step``: the appended tokens count."""
        self.lens += self.append[step]
        self.steps_done = step + 1

    # ---- figures

    def tokens(self) -> int:
        """Tokens whose K/V this rank holds now (host: the schedule, no device read)."""
        return sum(self.prefill_tokens) + sum(step[p] == self.rank for step in self.schedule.appends[:self.steps_done]
                                              for p in self.rows)

    def bytes_per_token(self) -> int:
        """K and V of one token over every layer, this rank's heads."""
        k = self.k[0] if self.k else None
        return 0 if k is None else 2 * len(self.k) * k.shape[1] * k.shape[2] * k.element_size()

    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
