"""The greedy pass's steps, written on arrays, give what plain references written here member by member give, bit
for bit, at few members and at many: the level of an unequal split, the compute of its members and of a head-tail
group's, the head-tail layouts, the ranked order kept as loads change, the group search with its filters (against the
search over every size, member by member), the Whole-Doc step and the passes that start where the first stopped."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from flashpar.cp import CostModel
from flashpar.cp.cp_plan import causal_pairs
from flashpar.cp.flashcp import greedy as greedy_module
from flashpar.cp.flashcp.arrays import falls_to_nonnegative
from flashpar.cp.flashcp.greedy import Greedy
from flashpar.cp.flashcp.ranks import Ranked
from flashpar.cp.flashcp.splits import Split, headtail_arrays, sized_arrays
from flashpar.cp.flashcp.trade import next_trade
from flashpar.cp.strategies import Placement, chunk_bounds, sized_pieces


def greedy(n: int, seed: int = 0) -> Greedy:
    rng = random.Random(seed)
    lens = [rng.randint(1, 40000) for _ in range(3 * n)]
    return Greedy(lens, n, CostModel(), int(1.05 * sum(lens) / n))


def test_level_and_sized_work_on_arrays_equal_python():
    """``_level`` (the parts of an unequal split at one level of compute) and ``sized_work`` (its members' compute)
    equal a walk over the level's points and the cost model piece by piece, from 2 members to 200."""
    g, rng = greedy(256), random.Random(1)
    for trial in range(40):
        m = rng.randint(2, 32) if trial % 2 else rng.randint(33, 200)
        length = rng.randint(m, 200000)
        load = [rng.uniform(0, g.mean) for _ in range(m)]
        toks = [rng.randint(0, g.cap) for _ in range(m)]
        rates = [g.whole(length) / length * rng.uniform(0.9, 1.3) for _ in range(m)]
        top = rng.choice([g.cap, rng.uniform(1, g.cap)])
        got = g._level(length, np.asarray(load), np.asarray(toks), np.asarray(rates), top).tolist()
        assert got == python_level(g, length, load, toks, rates, top)
        sizes = [rng.randint(0, 3000) for _ in range(m - 1)]
        sizes.append(length - sum(sizes)) if sum(sizes) < length else sizes.append(0)
        start, total = rng.randint(0, 10**6), sum(sizes)
        members = sized_pieces(sizes, start, total)
        placed = [(a, b, k) for k, ps in enumerate(members) for a, b in ps if b > a]
        ahead = lambda a, placed=placed: len({k for _, y, k in placed if y <= a})  # noqa: E731 - holders ahead
        ref = [sum(g.cost.piece_cost(b - a, a - start, ahead(a)) for a, b in ps if b > a)
               + g.cost.linear_time(sum(b - a for a, b in ps)) for ps in members]
        assert g.sized_work(start, total, sizes) == ref


def python_level(g, length, load, toks, rates, top):
    """``_level``'s walk over the points where the sum's slope changes, in Python (the reference)."""
    caps = [max(0.0, min(g.cap - t, top)) for t in toks]
    events = sorted([(ld, 1 / w) for ld, w in zip(load, rates, strict=True)]
                    + [(ld + w * c, -1 / w) for ld, w, c in zip(load, rates, caps, strict=True)])
    total, slope, lam = 0.0, 0.0, events[0][0]
    for x, step in events:
        if total + slope * (x - lam) >= length - 1e-6:
            lam += max(0.0, length - total) / slope if slope > 0 else 0.0
            break
        total, lam, slope = total + slope * (x - lam), x, slope + step
    sizes = [int(max(0.0, min((lam - ld) / w, c))) for ld, w, c in zip(load, rates, caps, strict=True)]
    rest = length - sum(sizes)
    for i, t in enumerate(toks):
        add = max(0, min(rest, g.cap - t - sizes[i]))
        sizes[i] += add
        rest -= add
    return sizes


def python_shares(g, length: int, size: int) -> tuple[list[float], list[int]]:
    """Compute and tokens of each member of a head-tail group of ``size`` over a document of ``length``, member by
    member (the reference): chunks ``i`` and ``2 size - 1 - i`` of ``2 size``, each piece at ``CostModel.piece_cost``
    with as many holders as distinct members hold a nonempty chunk ahead of it."""
    b = chunk_bounds(0, length, 2 * size)
    owners = [c if c < size else 2 * size - 1 - c for c in range(2 * size)]
    seen, holders = set(), []
    for c, owner in enumerate(owners):
        holders.append(len(seen))
        if b[c + 1] > b[c]:
            seen.add(owner)
    work, toks = [], []
    for i in range(size):
        pieces = ((b[i], b[i + 1], holders[i]), (b[2 * size - 1 - i], b[2 * size - i], holders[2 * size - 1 - i]))
        t = sum(g.cost.piece_cost(y - x, x, m) for x, y, m in pieces if y > x)
        n_tok = sum(y - x for x, y, _ in pieces)
        work.append(t + g.cost.linear_time(n_tok))
        toks.append(n_tok)
    return work, toks


def test_head_tail_shares_on_arrays_equal_member_by_member():
    """``shares`` (a head-tail group's compute and tokens per member, on arrays) equals the member-by-member
    reference, and ``_share_tokens`` its tokens, from 2 members to 300 (the sizes the group search tries, made
    several at once, and others), documents shorter than the group's chunks (empty chunks) included, under both cost
    models."""
    rng = random.Random(11)
    for cost in (CostModel(), CostModel(linear=False).with_hardware(attn_half=0.0)):
        g = Greedy([1000] * 300, 300, cost, 2000)
        for _ in range(150):
            size = rng.choice((*g.sizes, rng.randint(2, 300)))
            length = rng.choice((1, size, rng.randint(1, 3 * size), rng.randint(1, 300000)))
            assert g.shares(length, size) == python_shares(g, length, size), (length, size)
            assert g._share_tokens(length, size).tolist() == python_shares(g, length, size)[1]


def members_fit(keys, work, tok, limit: float, cap: int) -> bool:
    """Whether the first ``len(work)`` ranks of ``keys`` ((load, tokens, rank), member ``i`` taking ``work[i]`` and
    ``tok[i]``) all stay within ``limit`` and ``cap``, member by member (the reference)."""
    return all(ld + w <= limit and t + x <= cap for (ld, t, _), w, x in zip(keys, work, tok, strict=False))


def test_layouts_on_arrays_equal_placement():
    rng = random.Random(2)
    splits = []
    for _ in range(30):
        start, length, g = rng.randint(0, 10**6), rng.randint(2, 50000), rng.randint(2, 70)
        ranks = rng.sample(range(300), g)
        equal = rng.random() < 0.5
        parts = ([length * (i + 1) // (2 * g) - length * i // (2 * g) + length * (2 * g - i) // (2 * g)
                  - length * (2 * g - 1 - i) // (2 * g) for i in range(g)] if equal else
                 np.diff(np.sort(rng.sample(range(1, length), min(g - 1, length - 1))), prepend=0,
                         append=length).tolist())
        splits.append(Split(start, length, dict(zip(ranks, parts, strict=False)), equal))
    p = Placement(300)
    for sp in splits:
        if sp.equal:
            p.headtail(list(sp.parts), sp.start, sp.length)
        else:
            members = sorted(sp.parts, key=lambda r: -sp.parts[r])
            p.headtail_sized(members, [sp.parts[r] for r in members], sp.start, sp.length)
    want = sorted((r, a, b) for r, segs in enumerate(p.segments) for a, b in segs)
    got = []
    for arrays in (headtail_arrays([sp for sp in splits if sp.equal]),
                   sized_arrays([sp for sp in splits if not sp.equal])):
        got += [(r, a, b) for r, a, b in zip(*(x.tolist() for x in arrays), strict=True) if b > a]
    assert sorted(got) == want


@pytest.mark.parametrize("ranks", [8, 256])
def test_ranked_order_and_group_search_equal_a_sort_and_every_size(ranks):
    """Random loads (ties included) on 8 and 256 ranks: the ranked order equals a sort after single and wide changes,
    and _group's answer equals the search over every size member by member (its filters pass no fitting size over)."""
    g, rng = greedy(ranks, 3), random.Random(4)
    g.peak_share = 0.0  # (what a pass starts from)
    n, ranked = g.n, Ranked(g.n)
    load, toks = [0.0] * n, [0] * n
    found = 0
    for step in range(300):
        changed = rng.sample(range(n), min(n, rng.choice([1, 3, 100])))
        for q in changed:
            load[q] = rng.choice([load[q] + rng.uniform(0, 0.2 * g.mean), round(load[q], 1)])
            toks[q] = min(g.cap, toks[q] + rng.randint(0, g.cap // 8))
        ranked.update_many(changed, load, toks)
        want = sorted(zip(load, toks, range(n), strict=True))
        assert ranked.keys == want and ranked.toks.tolist() == [float(t) for _, t, _ in want]
        assert ranked.loads.tolist() == [ld for ld, _, _ in want]
        most = rng.randint(1, n)  # the prefixes kept between changes equal ones made anew, float for float
        top, sums = ranked.top_prefix(most), ranked.sum_prefix(most)
        assert top[:most].tolist() == np.maximum.accumulate(ranked.toks[:most]).tolist()
        assert sums[:most].tolist() == np.cumsum(ranked.loads[:most]).tolist()
        length = rng.choice([rng.randint(1, 3000), rng.randint(3000, 300000)])
        for limit, share in ((g.mean * rng.uniform(1.0, 1.5), rng.choice([1.0, 0.45])), (math.inf, math.inf)):
            got = g._group(length, ranked, limit, share)
            assert got == every_size(g, length, want, limit, share), (step, length, limit, share)
            found += got is not None
    assert found > 20  # (the search finds groups, not only None)


def every_size(g, length, keys, limit, share):
    first = max(2, min(g.n, math.ceil(g.whole(length) / (share * g.mean)))) if share < math.inf else 2
    for size in g.sizes:
        if size < first:
            continue
        if keys[size - 1][0] >= limit:
            return None
        work, tok = python_shares(g, length, size)
        if max(work) > share * g.mean and size < g.n:
            continue
        if members_fit(keys, work, tok, limit, g.cap):
            return [key[2] for key in keys[:size]]
    return None


def test_next_trade_by_rate_equals_the_pair_by_pair_scan():
    """trade.next_trade: the first pair that trades, pair by pair (the scan's conditions written out), equals the
    windowed scan and the look at the pairs by rate alone, rates tied, parts and excesses at the bounds, and pairs
    whose quotient ``room / gain`` is exactly EXCHANGE_MIN."""
    from flashpar.cp.flashcp.trade import EXCHANGE_MIN

    rng = np.random.default_rng(5)
    hits = 0
    for _ in range(150):
        m = int(rng.integers(1100, 2600))
        rates = rng.random(int(rng.integers(2, 60))) * 1e-9
        prate = rng.choice(rates, m)
        rate_b = float(rng.choice(rates))
        room = float(rng.uniform(0.0, 300.0)) * 1e-9 / EXCHANGE_MIN
        edge = rng.random(m) < 0.05  # (exactly at the room's bound)
        prate[edge] = rate_b + room / EXCHANGE_MIN
        ppart = rng.choice([0.0, EXCHANGE_MIN - 1, EXCHANGE_MIN, 500.0], m)
        excess = rng.choice([-1.0, 0.0, 1.0, 100.0], m) * 1e-9
        pos = int(rng.integers(0, m - 1025))
        want = -1
        for i in range(pos, m):
            gain = float(prate[i]) - rate_b
            if gain > 0 and ppart[i] >= EXCHANGE_MIN and float(excess[i]) / gain >= EXCHANGE_MIN and (
                    room / gain >= EXCHANGE_MIN):
                want = i
                break
        order = np.argsort(prate, kind="stable")
        with np.errstate(divide="ignore", invalid="ignore"):
            assert next_trade(pos, prate, rate_b, ppart, excess, room) == want
            by_rate = order, prate[order], ppart[order], excess[order]
            assert next_trade(pos, prate, rate_b, ppart, excess, room, by_rate) == want
        hits += want >= 0
    assert 20 < hits < 140  # (both answers met)


def test_whole_doc_step_in_runs_and_in_short_equals_the_plain_greedy(monkeypatch):
    """The Whole-Doc step, as the pass takes it (runs of one length in one sort, ``_batch_whole``; one by one from the
    top of the heap; the least key on arrays after many full ranks), places every document where the plain rule
    does: longest first, on the rank of least ``(max(load / limit, tokens / cap), load, rank)`` among those it fits
    (loads added one by one).  Packs of long runs of a few lengths (equal loads and tokens: ties) between single
    documents, all fitting, where loads decide (a loose cap) and where tokens do (no work bound); the refinement
    off."""
    monkeypatch.setattr(greedy_module, "refine", lambda *args: None)
    rng = random.Random(5)
    for n, docs in ((3, 300), (8, 600), (64, 700), (100, 500), (300, 6000)):
        lens = [rng.choice((3, 40, 300)) if rng.random() < 0.6 else rng.randint(1, 400) for _ in range(docs)]
        for cap_over, tol in ((2.0, 0.15), (1.1, math.inf)):
            g = Greedy(lens, n, CostModel(), int(cap_over * sum(lens) / n) + 400)
            limit = (1 + tol) * g.mean
            load, toks, want = [0.0] * n, [0] * n, [0] * len(lens)
            for d in sorted(range(len(lens)), key=lambda i: -lens[i]):
                w = g.whole(lens[d])
                r = min((q for q in range(n) if toks[q] + lens[d] <= g.cap and load[q] + w <= limit),
                        key=lambda q: (max(load[q] / limit, toks[q] / g.cap), load[q], q))
                load[r] += w
                toks[r] += lens[d]
                want[d] = r
            p = g.run(tol, 0, subgroups=tol < math.inf)
            assert p.docs is not None, (n, tol)  # (every document whole)
            got = [0] * len(lens)
            for d, r in zip(p.docs.tolist(), p.rank.tolist(), strict=True):
                got[d] = r
            assert got == want, (n, tol)


def test_per_doc_arrays_equals_per_doc():
    from flashpar.cp.strategies import ArrayPlacement, per_doc, per_doc_arrays

    rng = random.Random(3)
    for _ in range(200):
        n = rng.choice((1, 2, 3, 8, 33))
        lens = [rng.choice((1, 2, 3, rng.randint(1, 5000))) for _ in range(rng.randint(1, 40))]
        want, got = ArrayPlacement.of(per_doc(lens, n)), per_doc_arrays(lens, n)
        assert got.key() == want.key() and got.frozen() == want.frozen() and got.rank.dtype == want.rank.dtype


def test_passes_started_where_the_first_stopped_keying_by_tokens_equal_passes_from_the_start():
    """A pass of force 0 after the first starts from the state where the first pass's keys stopped
    being the tokens' alone (``_Prefix``): every such pass, of any higher limit, share or without sub-groups, gives the
    placement it gives from the start (a fresh pass).  Packs of many short documents (long runs of equal lengths: ties)
    after a few long ones, where that state lies inside the pass, and a pack of all-distinct lengths."""
    from flashpar.bench.plan_targets import short_docs

    rng = random.Random(3)
    packs = [(short_docs(32768, 1000), 8), (short_docs(16384, 900), 3), (short_docs(8192, 600), 4),
             ([rng.choice((2, 5, 9, 60)) if rng.random() < 0.9 else rng.randint(100, 3000) for _ in range(600)], 16),
             (rng.sample(range(1, 5000), 200), 64), (short_docs(262144, 3000), 256)]
    inside = 0
    for lens, n in packs:
        cap = int(1.05 * sum(lens) / n)
        g = Greedy(lens, n, CostModel(), cap)
        g.run(0.0, 0)
        inside += 0 < g._prefix.k < len(lens)
        for tol, share, subgroups in ((math.inf, 1.0, False), (0.02, 1.0, True), (0.0, 0.45, True), (0.05, 0.7, True),
                                      (0.0, 1.0, True)):
            got = g.run(tol, 0, share, subgroups)
            want = Greedy(lens, n, CostModel(), cap).run(tol, 0, share, subgroups)
            assert got.key() == want.key(), (n, tol, share, subgroups)
    assert inside >= 2  # (the passes after the first did start inside the pass)


def test_per_length_values_gathered_equal_per_document_values():
    """Formulas elementwise in the length, run once per distinct length and gathered per document (``Greedy.distinct``,
    ``doc_run``), give every document's own floats: whole compute, whole attention times, the cut bound's attention;
    and ``works_rise`` says whether compute rises with length over all lengths (the refinement's shortcut)."""
    from flashpar.cp.cp_plan import whole_doc_times
    from flashpar.cp.flashcp.bounds import cut_attn

    rng = random.Random(9)
    for n, cost in ((8, CostModel()), (3, CostModel(linear=False).with_hardware(attn_half=0.0)), (64, CostModel())):
        lens = [rng.choice((1, 2, 7, 300, 4096)) if rng.random() < 0.7 else rng.randint(1, 9000) for _ in range(700)]
        g = Greedy(lens, n, cost, int(1.05 * sum(lens) / n))
        lens_np = np.asarray(lens, dtype=np.int64)
        assert g.distinct[g.doc_run].tolist() == lens
        q = lens_np.astype(np.float64)
        assert g.whole_times()[1].tolist() == whole_doc_times(lens_np, cost).tolist()
        assert [g.whole(x) for x in lens] == (q * cost.flops_per_token / cost.hardware.gemm_flops + cost.attn_times(
            lens_np * (lens_np + 1) // 2, q, q)).tolist()
        assert cut_attn(lens_np, n, cost, (g.distinct, g.doc_run)).tolist() == cut_attn(lens_np, n, cost).tolist()
        works = [g.whole(x) for x in sorted(set(lens))]
        assert g.works_rise == (works == sorted(works) and works[0] >= 0)
    for values, want in (([3.0, 2.0, 2.0, 0.0], True), ([3.0, 2.0, 2.5, 1.0], False), ([2.0, -1.0], False),
                         ([float("nan"), 1.0], False), ([1.0], True)):
        assert falls_to_nonnegative(np.asarray(values)) == want, values


def test_pair_balance_on_arrays_equals_the_pairs_counted_piece_by_piece():
    """The attention-alone filter's figures (``pick.pair_balance``): each rank's causal pairs added piece by piece in
    Python (``causal_pairs`` from the piece's document start), max / mean, and the most tokens of a rank, on the
    candidates of random packs (whole, split and cut documents; ranks that hold nothing)."""
    from flashpar.cp.flashcp.pick import pair_balance
    from flashpar.cp.strategies import ArrayPlacement, headtail, per_doc_arrays, torch_per_doc

    rng = random.Random(11)
    for _ in range(40):
        n = rng.choice((1, 2, 3, 8, 17))
        lens = [rng.choice((1, 2, rng.randint(1, 300), rng.randint(1, 40000))) for _ in range(rng.randint(1, 30))]
        g = Greedy(lens, n, CostModel(linear=False), int(1.05 * sum(lens) / n) + 1)
        starts = g.starts_np.tolist()
        for p in (g.run(0.0, 0), g.run(0.02, 1, 0.25), per_doc_arrays(lens, n), headtail(lens, n, g.starts_np),
                  ArrayPlacement.of(torch_per_doc(lens, n, False)), ArrayPlacement(n, *(np.zeros(0, np.int64),) * 3)):
            pairs = [sum(causal_pairs(a, b, max(s for s in starts if s <= a)) for a, b in segs) for segs in p.frozen()]
            mean = sum(pairs) / n
            want = (max(pairs) / mean if mean > 0 else 1.0), max(sum(b - a for a, b in segs) for segs in p.frozen())
            assert pair_balance(p, g.starts_np) == want


def test_force_one_is_skipped_only_where_its_passes_equal_force_zeros():
    """``Greedy.forcing_changes_nothing``: where it says the passes of force 1 change nothing, each of them gives the
    placement of force 0 with the same tolerance and share (fresh greedies, both cost models); it says so on some
    packs (a long document over the work bound) and not on others (the longest fits whole)."""
    from flashpar.cp.flashcp.policy import Policy

    grid = Policy.for_ranks(8)
    rng = random.Random(13)
    said = {True: 0, False: 0}
    for trial in range(30):
        n = rng.choice((2, 3, 4, 8))
        lens = [rng.randint(1, 3000) for _ in range(rng.randint(2, 40))]
        if trial % 2:
            lens.insert(rng.randrange(len(lens)), rng.randint(3000, 40000))  # (over the mean work of a rank)
        cost = rng.choice((CostModel(), CostModel(linear=False).with_hardware(attn_half=0.0)))
        cap = int(1.05 * sum(lens) / n) + 1
        if max(lens) > cap:
            continue
        g = Greedy(lens, n, cost, cap)
        skip = g.forcing_changes_nothing(grid.tolerances, grid.shares)
        said[skip] += 1
        if skip:
            for tol in grid.tolerances:
                for share in grid.shares:
                    got = Greedy(lens, n, cost, cap).run(tol, 1, share)
                    assert got.key() == Greedy(lens, n, cost, cap).run(tol, 0, share).key(), (trial, tol, share)
    assert said[True] >= 3 and said[False] >= 3, said


def test_fill_rooms_order_equals_a_sort_by_room_then_rank():
    """``_fill_rooms``: the ranks by room (largest first, the higher rank on ties; rooms tied on purpose), their
    running sum, how many join (while the sum is under ``need`` and the room at least one token) and the largest
    room, against a sort and a loop in Python."""
    g, rng = greedy(64, 2), random.Random(12)
    for _ in range(200):
        load = [rng.choice((0.0, g.mean * 0.5, rng.uniform(0, 1.2 * g.mean))) for _ in range(g.n)]
        toks = [rng.choice((0, g.cap // 2, g.cap, rng.randint(0, g.cap))) for _ in range(g.n)]
        per_tok, top = g.mean / g.cap * rng.uniform(0.5, 2.0), rng.choice((g.cap, rng.uniform(1, g.cap)))
        need, limit = rng.uniform(1, 5 * g.cap), g.mean * rng.uniform(1.0, 1.1)
        room = [min((limit - load[r]) / per_tok, float(g.cap - toks[r]), top) for r in range(g.n)]
        order = sorted(range(g.n), key=lambda r: (-room[r], -r))
        acc, k = 0.0, 0
        while k < g.n and acc < need and room[order[k]] >= 1:
            acc += room[order[k]]
            k += 1
        got = g._fill_rooms(np.asarray(load), np.asarray(toks), limit, per_tok, top, need)
        assert (got[0], got[1], got[2].tolist(), got[3]) == (acc, k, order[:k], room[order[0]])
