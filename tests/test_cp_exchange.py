"""The K/V exchange schedules of every plan pattern, for every rank, in one process.

A symbolic run delivers the messages of all ranks' schedules (exchange ``i`` of one rank pairs
with exchange ``i`` of its peer) and tracks what each buffer holds: forward, which block's K/V
and how many rows; backward, which (rank, block) gradient shares a sum contains.
"""

from __future__ import annotations

import collections

import pytest

from flashpar.cp import STRATEGIES, plan
from flashpar.cp.exchange import kv_schedule
from flashpar.cp.layout import rank_layout
from flashpar.overlap.schedule import Add, Compute, Exchange, Wait

LENS = {"mixed": [90, 3, 5, 1, 40, 2, 7, 12], "ones": [1, 1, 1, 5, 1], "single": [61]}
SIZES = [1, 2, 3, 4]


def _layouts(lens, n, strategy):
    p = plan(lens, n, strategy=strategy)
    return p, [rank_layout(p, r) for r in range(n)]


def _run(layouts, direction):
    """Deliver every message; returns per rank the final buffers and the messages' rows."""
    n = len(layouts)
    scheds = [kv_schedule(lo, direction) for lo in layouts]
    held = [{} for _ in range(n)]  # rank -> {(buffer, block, peer): (content, rows)}
    grads = [collections.defaultdict(collections.Counter) for _ in range(n)]  # rank -> block -> shares
    pos = [0] * n
    sent_rows = [collections.Counter() for _ in range(n)]  # rank -> peer -> rows sent

    def content(r, t):
        lo = layouts[r]
        if t.buffer in ("k", "v"):
            if t.piece.block == r:
                return ("kv", r, t.buffer)
            got = held[r].get((t.buffer, t.piece.block, None))
            assert got is not None, f"rank {r} forwards block {t.piece.block} before it arrived"
            return got[0]
        assert t.buffer in ("gk", "gv") and t.piece.block != lo.rank
        return collections.Counter(grads[r][(t.buffer, t.piece.block)])

    def advance(r, upto):
        """Run rank r's steps until it has submitted lane item ``upto`` (or to the end)."""
        messages = []
        steps = scheds[r].steps
        while pos[r] < len(steps):
            s = steps[pos[r]]
            if isinstance(s, Wait) and s.id >= upto:
                break
            pos[r] += 1
            if isinstance(s, Compute) and direction == "backward":
                for g in ("gk", "gv"):
                    grads[r][(g, s.piece.block)][(r, s.piece.block)] += 1
            elif isinstance(s, Add):
                got, _ = held[r].pop((s.src, s.piece.block, s.peer))
                grads[r][(s.dst, s.piece.block)].update(got)
            elif isinstance(s, Exchange):
                messages.append(s)
                if s.id == upto:
                    break
        return messages

    items = max((len(s.lane_items()) for s in scheds), default=0)
    for i in range(items + 1):
        posted = {r: [m for m in advance(r, i) if m.id == i] for r in range(n)}
        for r, exchanges in posted.items():
            for ex in exchanges:
                for t in ex.sends:
                    rows = layouts[r].held_rows(t.piece.block, t.peer)
                    sent_rows[r][t.peer] += rows
                    peer_ex = next(e for e in posted[t.peer] if e.id == i)
                    recv = [x for x in peer_ex.recvs if x.peer == r and x.buffer[-1] == t.buffer[-1]]
                    assert len(recv) == 1, (direction, r, t, peer_ex)
                    x = recv[0]
                    assert layouts[t.peer].held_rows(x.piece.block, r) == rows, "sender and receiver agree on rows"
                    key = (x.buffer, x.piece.block, None if direction == "forward" else r)
                    assert key not in held[t.peer], f"rank {t.peer} receives {key} twice"
                    held[t.peer][key] = (content(r, t), rows)
    return scheds, held, grads, sent_rows


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("lens", list(LENS))
def test_forward_brings_every_block_once_from_its_origin(lens, n, strategy):
    p, layouts = _layouts(LENS[lens], n, strategy)
    scheds, held, _, sent_rows = _run(layouts, "forward")
    for r, lo in enumerate(layouts):
        for buf in ("k", "v"):
            got = {o: v for (b, o, _), v in held[r].items() if b == buf}
            assert sorted(got) == [o for o in range(n) if o != r], "one receive per origin"
            for o, (what, rows) in got.items():
                assert what == ("kv", o, buf), f"rank {r} holds {what} where block {o}'s {buf} belongs"
                assert rows == lo.recv_tokens(o) == sum(b - a for src, a, b in p.kv_recv(r) if src == o) \
                    if lo.pattern == "p2p" else rows == lo.recv_tokens(o)
        if lo.pattern != "ring":  # direct sends: each peer gets exactly the layout's rows for it, K and V
            assert sent_rows[r] == collections.Counter({d: 2 * lo.send_tokens(d) for d in range(n) if d != r})
        first = scheds[r].computes()[0]
        assert first.piece.block == r and scheds[r].steps.index(first) == n - 1, "local first, after posting"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_forwards_what_arrived_one_step_earlier(n):
    _, layouts = _layouts(LENS["mixed"], n, "headtail")
    for r, lo in enumerate(layouts):
        assert lo.pattern == "ring"
        for j, ex in enumerate(kv_schedule(lo, "forward").lane_items(), start=1):
            assert {t.peer for t in ex.sends} == {(r + 1) % n} and {t.peer for t in ex.recvs} == {(r - 1) % n}
            assert {t.piece.block for t in ex.sends} == {(r - j + 1) % n}
            assert {t.piece.block for t in ex.recvs} == {(r - j) % n}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n", SIZES)
def test_backward_returns_every_share_once_and_one_row_per_received_row(n, strategy):
    _, layouts = _layouts(LENS["mixed"], n, strategy)
    scheds, held, grads, sent_rows = _run(layouts, "backward")
    for r, lo in enumerate(layouts):
        assert not held[r], f"rank {r} received gradients it never added: {list(held[r])}"
        for g in ("gk", "gv"):
            assert grads[r][(g, r)] == collections.Counter({(s, r): 1 for s in range(n)}), \
                "the own block's gradient sums every rank's share exactly once"
        if lo.pattern != "ring":  # returns exactly the rows received in the forward, to their origin
            assert sent_rows[r] == collections.Counter({o: 2 * lo.recv_tokens(o) for o in range(n) if o != r})
        computes = [c.piece.block for c in scheds[r].computes()]
        assert computes == [(r - j) % n for j in range(1, n)] + [r], "remote first, the local block last"
        local = scheds[r].steps.index(scheds[r].computes()[-1])
        assert all(isinstance(s, (Wait, Add)) for s in scheds[r].steps[local + 1:]), "only adds after the tail"


def test_every_exchange_buffer_is_declared():
    _, layouts = _layouts(LENS["mixed"], 3, "flashcp")
    for direction in ("forward", "backward"):
        s = kv_schedule(layouts[1], direction)
        assert s.named() == {d.name for d in s.buffers}
    with pytest.raises(ValueError, match="direction must be 'forward' or 'backward'"):
        kv_schedule(layouts[0], "sideways")
