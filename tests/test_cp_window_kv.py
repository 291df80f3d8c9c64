"""The K/V a windowed layer exchanges, at the planning level (no processes): on ``wlbllm`` 128K-token packs over 8
ranks with W = 4096, what the layouts send is exactly what the ranks' windows reach outside their own tokens (a
direct count on token masks), and on the default planner's plans at most half of what the same plans send without
the window."""

from __future__ import annotations

import numpy as np
import pytest

from flashpar.cp import STRATEGIES, plan
from flashpar.cp import window as band
from flashpar.cp.layout import rank_layout
from flashpar.cp.lengths import resolve_lengths

TOKENS, RANKS, W, PACKS = 131072, 8, 4096, 4


@pytest.fixture(scope="module")
def packs():
    return resolve_lengths("wlbllm").packs(TOKENS, PACKS, seed=0)


def direct_need(p, rank: int, window: int) -> int:
    """Keys outside ``rank``'s own tokens that some of its queries' windows reach, counted on a token mask: query
    ``q`` of a document starting at ``s`` reaches ``[max(s, q - W + 1), q]``, so a piece ``[a, b)`` reaches
    ``[max(s, a - W + 1), b)``."""
    starts = np.cumsum([0, *p.doc_lens[:-1]])
    own = np.zeros(p.total_tokens, dtype=bool)
    reached = np.zeros(p.total_tokens, dtype=bool)
    for a, b in p.segments[rank]:
        s = starts[np.searchsorted(starts, a, side="right") - 1]
        own[a:b] = True
        reached[max(s, a - window + 1):b] = True
    return int((reached & ~own).sum())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_windowed_exchange_is_exactly_the_windows_need(packs, strategy):
    for lens in packs[:2]:
        p = plan(lens, RANKS, strategy=strategy)
        kv = p.cost.kv_bytes_per_token
        need = [direct_need(p, r, W) * kv for r in range(RANKS)]
        layouts = [rank_layout(p, r, False, None, W) for r in range(RANKS)]
        received = [sum(lo.recv_tokens(o) for o in range(RANKS)) * kv for lo in layouts]
        sent = sum(lo.send_tokens(d) for lo in layouts for d in range(RANKS) if d != lo.rank) * kv
        assert received == need, strategy
        assert sent == sum(need), strategy
        assert band.recv_tokens(p, W) == [x // kv for x in need]


def test_windowed_exchange_is_at_most_half_the_full_one(packs):
    """Summed over the packs, flashcp's plans send under W = 4096 at most half the K/V they send without it (per
    pack never more: a pack whose cut documents lie within one window sends the same)."""
    windowed = full = 0
    for lens in packs:
        p = plan(lens, RANKS)
        kv = p.cost.kv_bytes_per_token
        w = sum(band.send_tokens(p, W)) * kv
        f = sum(p.stats()["kv_send_bytes"])
        assert w <= f and f == sum(b - a for r in range(RANKS) for _, a, b in p.kv_recv(r)) * kv
        windowed, full = windowed + w, full + f
    assert full > 0 and windowed <= full / 2, (windowed, full)
