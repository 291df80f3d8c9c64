"""Properties of the pure schedules, for every (N, rank) in one process."""

from __future__ import annotations

import collections
import re

import pytest

from flashpar.overlap.schedule import (
    A2A_MODES,
    A2A_OPS,
    ALL,
    MODES,
    OPS,
    Add,
    Collective,
    Compute,
    Exchange,
    Piece,
    Wait,
    build_schedule,
    peer_order,
    peer_pieces,
    runs,
)
from flashpar.overlap.simulate import op_shapes

SIZES = [1, 2, 3, 4, 5]
FLAGS = [{}, {"grad_input": False}, {"grad_weight": False}, {"regather": False}, {"reduce_weight": True},
         {"grad_bias": True}]


def _all(op, mode, n, k=1, **kw):
    return [build_schedule(op, mode, n, r, chunks=k, **kw) for r in range(n)]


def _local(schedule):
    """The local block; a group of one computes everything as one piece."""
    return Piece(schedule.rank) if schedule.world_size > 1 else Piece(ALL)


def _p2p_messages(schedules, tags=False):
    """Multiset of (src, dst, piece) for sends and for receives (``tags``: with the buffers' message tag)."""
    sends, recvs = collections.Counter(), collections.Counter()
    for s in schedules:
        for item in s.lane_items():
            if isinstance(item, Exchange):
                for t in item.sends:
                    sends[(s.rank, t.peer, t.piece) + ((s.buffer(t.buffer).tag,) if tags else ())] += 1
                for t in item.recvs:
                    recvs[(t.peer, s.rank, t.piece) + ((s.buffer(t.buffer).tag,) if tags else ())] += 1
    return sends, recvs


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("k", [1, 3])
def test_flash_all_gather_is_local_first_and_each_block_arrives_once(n, k):
    for s in _all("ag_matmul", "flash", n, k):
        computes = s.computes()
        assert computes[0].piece == _local(s), "the local shard is computed first"
        assert not any(isinstance(st, Wait) for st in s.steps[: s.steps.index(computes[0])]), \
            "nothing waits before the local piece"
        remote = [c.piece for c in computes[1:]]
        assert sorted(remote, key=lambda p: (p.block, p.chunk)) == sorted(
            (Piece(j, c, k) for j in range(n) if j != s.rank for c in range(k)), key=lambda p: (p.block, p.chunk))
    sends, recvs = _p2p_messages(_all("ag_matmul", "flash", n, k))
    assert sends == recvs, "every message sent is received, by the right peer, exactly once"
    assert all(v == 1 for v in sends.values())
    # direct transfers: a rank only ever sends its own block (no forwarding)
    assert all(piece.block == src for (src, _dst, piece) in sends)
    assert len(sends) == n * (n - 1) * k


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("k", [1, 2])
def test_flash_reduce_scatter_is_local_last(n, k):
    for s in _all("matmul_rs", "flash", n, k):
        partials = [c for c in s.computes() if c.gemm == "p"]
        assert partials[-1].piece == _local(s) and partials[-1].dst == "y", "the local block is computed last"
        assert all(c.piece.block != s.rank for c in partials[:-1])
        # each peer block is sent right after it was computed
        steps = list(s.steps)
        for c in partials[:-1]:
            nxt = steps[steps.index(c) + 1]
            assert isinstance(nxt, Exchange) and nxt.sends[0].piece == c.piece and nxt.sends[0].peer == c.piece.block
        adds = [st for st in s.steps if isinstance(st, Add)]
        assert len(adds) == (n - 1) * k and all(st.dst == "y" for st in adds)
        if n > 1:  # a group of one has nothing to add
            assert steps.index(partials[-1]) < steps.index(adds[0]), "received partials are added after the local GEMM"
    sends, recvs = _p2p_messages(_all("matmul_rs", "flash", n, k))
    assert collections.Counter({(a, b, p): v for (a, b, p), v in sends.items()}) == recvs
    assert all(v == 1 for v in sends.values())


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_exchange_t_is_a_permutation(n):
    """In exchange t every rank sends to one peer and receives from one: no link carries two flows."""
    scheds = _all("ag_matmul", "flash", n)
    per_step = collections.defaultdict(list)
    for s in scheds:
        for i, item in enumerate(s.lane_items()):
            per_step[i].append((s.rank, item.sends[0].peer, item.recvs[0].peer))
    for entries in per_step.values():
        assert sorted(dst for _, dst, _ in entries) == list(range(n))
        for src, dst, _ in entries:
            assert (dst, src) in {(d, f) for d, _, f in entries}  # dst receives from src in the same step
    assert [t for t, _ in peer_order(n, 0)] == list(range(1, n))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_only_talks_to_neighbours_and_forwards(n):
    for op in ("ag_matmul", "matmul_rs"):
        for s in _all(op, "ring", n):
            for item in s.lane_items():
                assert all(t.peer == (s.rank + 1) % n for t in item.sends)
                assert all(t.peer == (s.rank - 1) % n for t in item.recvs)
    sends, recvs = _p2p_messages(_all("ag_matmul", "ring", n))
    assert sends == recvs
    assert any(piece.block != src for (src, _, piece) in sends) or n == 2, "ring forwards peers' blocks"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_slice_and_none_use_collectives_only(n):
    for op in OPS:
        for mode, k in (("slice", 3), ("none", 1)):
            for s in _all(op, mode, n, k):
                items = s.lane_items()
                assert items and all(isinstance(i, Collective) for i in items)
    s = build_schedule("ag_matmul", "slice", n, 0, chunks=3)
    first_wait = next(i for i, st in enumerate(s.steps) if isinstance(st, Wait))
    assert not any(isinstance(st, Compute) for st in s.steps[:first_wait]), "slice: the first gather is exposed"


def _read_before_arrival(s):
    """Reads of a received piece not preceded by a wait on its lane item or a later one (the lane is
    sequential: a completed item implies every earlier one).  Returns the offending steps."""
    def key(buffer, piece, peer):
        per_peer = s.buffer(buffer).kind in ("per_peer", "peer_slabs")
        return buffer, piece, peer if per_peer else -1

    arrives, waited, bad = {}, -1, []
    for st in s.steps:
        if isinstance(st, Exchange):
            for t in st.recvs:
                arrives[key(t.buffer, t.piece, t.peer)] = st.id
        elif isinstance(st, Wait):
            waited = max(waited, st.id)
        elif isinstance(st, (Compute, Add)):  # each block of a merged piece, each head group of a run
            peers = range(st.peer, st.peer + st.peers) if isinstance(st, Compute) else [st.peer]
            for j in range(st.piece.block, st.piece.block + st.piece.span):
                for peer in peers:
                    piece = Piece(j, st.piece.chunk, st.piece.chunks) if st.piece.span > 1 else st.piece
                    item = arrives.get(key(st.src, piece, peer))
                    if item is not None and item > waited:
                        bad.append(st)
    return bad


@pytest.mark.parametrize("op", OPS[:4])
@pytest.mark.parametrize("mode", ["flash", "ring", "slice", "none"])
@pytest.mark.parametrize("n", SIZES)
def test_every_received_piece_is_waited_for_and_every_row_is_computed(op, mode, n):
    for s in _all(op, mode, n, 2):
        assert not _read_before_arrival(s), f"{op}/{mode} reads pieces before their transfer completed"
        items_with_recvs = [i.id for i in s.lane_items() if not isinstance(i, Exchange) or i.recvs]
        waits = [st.id for st in s.steps if isinstance(st, Wait)]
        assert not items_with_recvs or max(waits) >= max(items_with_recvs), "the last arriving item is waited"
        main = [c for c in s.computes() if c.gemm in ("y", "p", "gx")]
        covered = collections.Counter()
        for c in main:
            if c.piece.block == ALL and c.piece.chunks == 1:
                covered.update((j, cc, 2) for j in range(n) for cc in range(2))
            elif c.piece.chunks == 1:
                covered.update((c.piece.block, cc, 2) for cc in range(2))
            else:
                covered[(c.piece.block, c.piece.chunk, c.piece.chunks)] += 1
        assert set(covered) == {(j, cc, 2) for j in range(n) for cc in range(2)}
        assert all(v == 1 for v in covered.values()), f"{op}/{mode} computes some rows twice"


def test_backward_gradient_flags():
    s = build_schedule("ag_matmul_bwd", "flash", 3, 1, grad_input=False, grad_weight=True)
    assert {c.gemm for c in s.computes()} == {"gw"}
    s = build_schedule("ag_matmul_bwd", "flash", 3, 1, grad_input=True, grad_weight=False)
    assert {c.gemm for c in s.computes()} == {"p"}
    assert not any(t.buffer == "x" for i in s.lane_items() for t in i.sends), "no re-gather without grad_W"
    s = build_schedule("ag_matmul_bwd", "flash", 3, 1, regather=False)
    assert not any(t.buffer == "x" for i in s.lane_items() for t in i.sends)
    s = build_schedule("matmul_rs_bwd", "flash", 3, 1, grad_bias=True)
    first = s.lane_items()[0]
    assert isinstance(first, Collective) and first.kind == "all_reduce", "bias all-reduce goes first"


@pytest.mark.parametrize("bad, message", [
    (dict(op="x"), "unknown op 'x'"), (dict(mode="y"), "unknown mode 'y'"),
    (dict(world_size=2, rank=2), "rank 2 is not in a group of size 2"), (dict(chunks=0), "chunks must be >= 1, got 0"),
])
def test_bad_arguments_are_named(bad, message):
    kw = dict(op="ag_matmul", mode="flash", world_size=2, rank=0) | bad
    chunks = kw.pop("chunks", 1)
    with pytest.raises(ValueError, match=message):
        build_schedule(kw["op"], kw["mode"], kw["world_size"], kw["rank"], chunks=chunks)


# ---- buffer declarations ----------------------------------------------------------------------


def _every_schedule():
    for op in OPS + A2A_OPS:
        for mode in MODES if op in OPS else A2A_MODES:
            for n in (1, 2, 3, 4):
                for flags in FLAGS:
                    yield [build_schedule(op, mode, n, r, chunks=2, **flags) for r in range(n)]


def test_every_buffer_a_step_names_is_declared_once_and_used():
    for scheds in _every_schedule():
        for s in scheds:
            names = [d.name for d in s.buffers]
            assert len(names) == len(set(names)), f"{s.op}/{s.mode}: a buffer declared twice"
            assert s.named() == set(names), f"{s.op}/{s.mode} N={s.world_size}: undeclared {s.named() - set(names)}, " \
                f"unused {set(names) - s.named()}"
            assert all(d.kind != "kernel" or d.tag == 0 for d in s.buffers), "kernel-owned buffers are never sent"


def test_messages_land_in_a_buffer_of_the_same_tag():
    """A send of one buffer is received on the peer into a buffer of the same tag (gloo matches by tag)."""
    for scheds in _every_schedule():
        sends, recvs = _p2p_messages(scheds, tags=True)
        assert sends == recvs, f"{scheds[0].op}/{scheds[0].mode}: sends and receives differ in piece or tag"
        assert all(tag > 0 for (*_, tag) in sends)


def test_the_simulator_sizes_every_transferred_buffer():
    """Every buffer a transfer or a collective moves has a width in the simulator's shapes."""
    sim = {"ag_matmul": "ag_matmul", "ag_matmul_bwd": "ag_matmul", "matmul_rs": "matmul_rs",
           "matmul_rs_bwd": "matmul_rs", "sharded": "sharded", "sharded_bwd": "sharded",
           "matmul_a2a": "matmul_a2a", "matmul_a2a_bwd": "matmul_a2a", "a2a_matmul": "a2a_matmul",
           "a2a_matmul_bwd": "a2a_matmul"}
    for scheds in _every_schedule():
        s = scheds[-1]
        shape = op_shapes(sim[s.op], s.world_size, 64, 8, 12, 4)[s.op]
        for item in s.lane_items():
            moved = [t.buffer for t in (*item.sends, *item.recvs)] if isinstance(item, Exchange) else \
                [] if item.kind == "all_reduce" else [item.src, item.dst]
            assert all(shape.width(s, b) > 0 for b in moved), (s.op, s.mode, moved)


def test_sharded_backward_names_its_own_roles():
    """grad_W travels (reduce-scattered to the shard's owner), grad_x is computed on the gathered shards."""
    s = build_schedule("sharded_bwd", "flash", 3, 1)
    assert {c.gemm for c in s.computes()} == {"gw", "gx"}
    assert {t.buffer for i in s.lane_items() for t in i.sends} == {"w", "send"}
    assert [c.dst for c in s.computes() if c.gemm == "gw"][-1] == "gw", "the own shard's gradient is computed last"
    only_x = build_schedule("sharded_bwd", "flash", 3, 1, grad_weight=False)
    assert {c.gemm for c in only_x.computes()} == {"gx"} and {d.name for d in only_x.buffers} == {"w", "gx"}


def test_describe_is_printable():
    text = build_schedule("matmul_rs", "flash", 2, 0, chunks=2).describe()
    assert "exchange" in text and "compute p" in text and "add y" in text


# ---- all-to-all (Ulysses) schedules -----------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("k", [1, 2])
def test_flash_matmul_a2a_sends_each_head_group_once_and_computes_the_own_group_last(n, k):
    scheds = _all("matmul_a2a", "flash", n, k)
    for s in scheds:
        p = [c for c in s.computes() if c.gemm == "p"]
        assert p[-1].peer == s.rank and p[-1].dst == "out", "the own head group is computed last, in place"
        assert all(c.peer != s.rank and c.dst == "send" for c in p[:-1])
        steps = list(s.steps)
        for c in p[:-1]:  # sent right after it was computed, to the head group's rank
            nxt = steps[steps.index(c) + 1]
            assert isinstance(nxt, Exchange) and nxt.sends[0].peer == c.peer and nxt.sends[0].piece == c.piece
        assert sorted((c.peer, c.piece.chunk) for c in p[:-1]) == sorted(
            (j, c) for j in range(n) if j != s.rank for c in range(k))
    sends, recvs = _p2p_messages(scheds)
    # rank i sends piece (i, c) of its tokens; its peer receives it as block i of 'out'
    assert sends == recvs and all(v == 1 for v in sends.values()) and len(sends) == n * (n - 1) * k
    assert all(piece.block == src for (src, _dst, piece) in sends)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("k", [1, 3])
def test_flash_a2a_matmul_is_local_first_and_sums_every_head_group_once(n, k):
    for op in ("a2a_matmul", "matmul_a2a_bwd"):
        scheds = _all(op, "flash", n, k)
        for s in scheds:
            gemm = "y" if op == "a2a_matmul" else "gx"
            terms = [c for c in s.computes() if c.gemm == gemm]
            assert terms[0].peer == s.rank and terms[0].src == "in", "the own head group first"
            assert not any(isinstance(st, Wait) for st in s.steps[: s.steps.index(terms[0])])
            rows = collections.Counter((c.peer, c.piece.chunk if c.piece.chunks > 1 else None) for c in terms[1:])
            assert set(rows) == {(j, c if k > 1 else None) for j in range(n) if j != s.rank for c in range(k)}
            assert all(v == 1 for v in rows.values())
        sends, recvs = _p2p_messages(scheds)
        # rank i sends block j of its head group's tokens to rank j, which receives it as its piece (j, c)
        assert sends == recvs and all(v == 1 for v in sends.values()) and len(sends) == n * (n - 1) * k
        assert all(piece.block == dst for (_src, dst, piece) in sends)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_a2a_backward_weight_terms_cover_the_local_block_and_reduce_last(n):
    for mode in ("flash", "slice", "none"):
        s = build_schedule("a2a_matmul_bwd", mode, n, 0, chunks=2, reduce_weight=True)
        gw = [c for c in s.computes() if c.gemm == "gw"]
        assert sorted(c.peer for c in gw) == list(range(n)) and all(c.src == "saved" for c in gw)
        reduces = [i for i in s.lane_items() if isinstance(i, Collective) and i.kind == "all_reduce"]
        assert len(reduces) == (n > 1)
        if mode == "flash" and n > 1:  # the all-reduce is posted before the own block's GEMM, which hides it
            local = [c for c in s.computes() if c.gemm == "p"][-1]
            assert s.steps.index(reduces[0]) < s.steps.index(local)
        s = build_schedule("matmul_a2a_bwd", mode, n, 0, chunks=2, reduce_weight=True)
        assert (s.steps[-1] == Wait(s.lane_items()[-1].id)) if n > 1 else not s.lane_items()


def test_a2a_modes_and_collectives():
    with pytest.raises(ValueError, match="unknown mode 'ring'"):
        build_schedule("matmul_a2a", "ring", 2, 0)
    for op in ("matmul_a2a", "a2a_matmul"):
        for mode, k in (("slice", 3), ("none", 1)):
            items = build_schedule(op, mode, 3, 1, chunks=k).lane_items()
            assert len(items) == k and all(isinstance(i, Collective) and i.kind == "all_to_all" for i in items)


def test_the_simulator_imports_without_torch_distributed():
    """The pure layer (schedules, row spaces, the simulator) never loads the executor or torch.distributed."""
    import subprocess
    import sys

    code = ("import sys, flashpar.overlap.simulate; "
            "print(sorted(m for m in sys.modules if m == 'torch.distributed' or m.endswith(('executor', 'lane'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


# ---- merged pieces (peers_per_piece) ----------------------------------------------------------

MERGED = ("ag_matmul", "matmul_rs", "ag_matmul_bwd", "matmul_rs_bwd", *A2A_OPS)
GATHERED = {"x", "g", "in"}  # buffers a schedule all-gathers / all-to-all-gathers (local block first)


def test_peer_pieces_are_the_shifts_in_order_balanced_and_small_next_to_the_local_block():
    assert peer_pieces(8, 3, local_first=True) == [(1, 2), (3, 4), (5, 6, 7)]
    assert peer_pieces(4, 2, local_first=False) == [(1, 2), (3,)]
    assert peer_pieces(5, 1, local_first=True) == [(1,), (2,), (3,), (4,)]
    assert peer_pieces(1, 3, local_first=True) == []
    for n in range(2, 11):
        for g in range(1, n + 2):
            for local_first in (True, False):
                pieces = peer_pieces(n, g, local_first=local_first)
                sizes = [len(p) for p in pieces]
                assert [t for p in pieces for t in p] == list(range(1, n)), "every shift once, in exchange order"
                assert len(pieces) == -(-(n - 1) // min(g, n - 1)) and max(sizes) <= g
                assert max(sizes) - min(sizes) <= 1, "as equal as possible"
                assert sizes == sorted(sizes, reverse=not local_first), "the smaller pieces next to the local block"
    assert runs([3, 0]) == [(0, 1), (3, 1)] and runs([5, 6, 7, 0, 1]) == [(0, 2), (5, 3)] and runs([2]) == [(2, 1)]


def _units(s):
    """Every compute as single (gemm, block, chunk, chunks, src, dst, head group) terms: a merged piece's
    blocks and a run of head groups expanded.  Merging must change how terms are grouped, never the terms."""
    out = collections.Counter()
    for c in s.computes():
        for j in range(c.piece.block, c.piece.block + c.piece.span):
            for p in range(c.peer, c.peer + c.peers):
                out[(c.gemm, j, c.piece.chunk, c.piece.chunks, c.src, c.dst, p)] += 1
    return out


def _exchange_shifts(s):
    """Per phase (gathered buffers / the rest), the shift sets of this rank's exchanges in lane order."""
    phases = collections.defaultdict(list)
    for item in s.lane_items():
        if isinstance(item, Exchange):
            sent = {(t.peer - s.rank) % s.world_size for t in item.sends}
            got = {(s.rank - t.peer) % s.world_size for t in item.recvs}
            assert sent == got, f"{s.op}: exchange #{item.id} sends to r+t and receives from r-t for the same t"
            phases[item.sends[0].buffer in GATHERED].append(tuple(sorted(sent)))
    return phases


def _merged_cases():
    for op in MERGED:
        for n in (1, 2, 3, 4, 5, 6):
            for g in range(2, n + 1):
                for flags in FLAGS:
                    yield op, n, g, flags


@pytest.mark.parametrize("op", MERGED)
def test_merged_pieces_move_and_compute_the_same_terms_grouped_per_piece(op):
    for op_, n, g, flags in _merged_cases():
        if op_ != op:
            continue
        for r in range(n):
            one = build_schedule(op, "flash", n, r, **flags)
            s = build_schedule(op, "flash", n, r, peers_per_piece=g, **flags)
            what = f"{op} N={n} r={r} g={g} {flags}"
            assert s.peers_per_piece == min(g, max(n - 1, 1)), what
            assert _units(s) == _units(one), f"{what}: merged computes differ from one piece per peer"
            adds = [collections.Counter(st for st in x.steps if isinstance(st, Add)) for x in (s, one)]
            assert adds[0] == adds[1], f"{what}: merged adds of received partials differ"
            assert not _read_before_arrival(s), f"{what}: reads a piece before its transfer completed"
            for phase, shifts in _exchange_shifts(s).items():
                assert shifts == peer_pieces(n, g, local_first=phase), f"{what}: exchanges are not the pieces"
            for c in s.computes():
                span = range(c.piece.block, c.piece.block + c.piece.span)
                assert c.piece.span == 1 or (span.stop <= n and r not in span), f"{what}: {c} wraps or holds r"
                assert c.peers == 1 or (c.peer + c.peers <= n and r not in range(c.peer, c.peer + c.peers)), what
        sends, recvs = _p2p_messages([build_schedule(op, "flash", n, r, peers_per_piece=g, **flags) for r in range(n)],
                                     tags=True)
        assert sends == recvs and all(v == 1 for v in sends.values()), f"{op} N={n} g={g}: unmatched messages"
        assert sends == _p2p_messages([build_schedule(op, "flash", n, r, **flags) for r in range(n)], tags=True)[0]


@pytest.mark.parametrize("n", [3, 4, 5, 6])
def test_merged_all_gather_is_local_first_and_one_gemm_per_run_of_each_piece(n):
    for g in range(2, n):
        for r in range(n):
            s = build_schedule("ag_matmul", "flash", n, r, peers_per_piece=g)
            steps = list(s.steps)
            first = steps.index(s.computes()[0])
            assert s.computes()[0].piece == Piece(r) and not any(isinstance(st, Wait) for st in steps[:first])
            items = s.lane_items()
            assert len(items) == len(peer_pieces(n, g, local_first=True)), "one lane item per merged piece"
            wrapped = 0
            for item in items:  # after each piece's one wait: one GEMM per run of its blocks
                after = steps[steps.index(Wait(item.id)) + 1:]
                after = after[: next((i for i, st in enumerate(after) if isinstance(st, Wait)), len(after))]
                blocks = sorted(t.peer for t in item.recvs)
                assert [c.piece for c in after] == [Piece(j, 0, 1, k) if k > 1 else Piece(j) for j, k in runs(blocks)]
                wrapped += len(after) > 1
            assert wrapped <= 1, "at most one piece wraps past rank 0"


@pytest.mark.parametrize("n", [3, 4, 5, 6])
def test_merged_reduce_scatter_is_local_last_and_sends_each_piece_as_computed(n):
    for op in ("matmul_rs", "ag_matmul_bwd"):
        for g in range(2, n):
            for r in range(n):
                s = build_schedule(op, "flash", n, r, peers_per_piece=g)
                partials = [c for c in s.computes() if c.gemm == "p"]
                assert partials[-1].piece == Piece(r) and partials[-1].dst in ("y", "gx"), "the local block last"
                steps = list(s.steps)
                scatter = [i for i in s.lane_items() if i.sends[0].buffer == "send"]
                assert [tuple(sorted((t.peer - r) % n for t in i.sends)) for i in scatter] == \
                    peer_pieces(n, g, local_first=False)
                for item in scatter:  # the piece's runs are computed right before its exchange
                    runs_before = []
                    for st in reversed(steps[: steps.index(item)]):
                        if not (isinstance(st, Compute) and st.dst == "send"):
                            break
                        runs_before.insert(0, st.piece)
                    blocks = sorted(t.peer for t in item.sends)
                    assert runs_before == [Piece(j, 0, 1, k) if k > 1 else Piece(j) for j, k in runs(blocks)]


@pytest.mark.parametrize("n", [3, 4, 5])
def test_merged_a2a_scatter_runs_head_groups_in_one_gemm_and_the_gather_side_one_per_group(n):
    for g in range(2, n):
        for r in range(n):
            s = build_schedule("matmul_a2a", "flash", n, r, peers_per_piece=g)
            p = [c for c in s.computes() if c.gemm == "p"]
            assert p[-1].peer == r and p[-1].peers == 1 and p[-1].dst == "out", "the own head group last"
            items = s.lane_items()
            assert len(items) == len(peer_pieces(n, g, local_first=False))
            sent = [runs([t.peer for t in i.sends]) for i in items]
            assert [(c.peer, c.peers) for c in p[:-1]] == [run for piece in sent for run in piece]
            s = build_schedule("a2a_matmul", "flash", n, r, peers_per_piece=g)
            y = s.computes()
            assert y[0].peer == r and all(c.peers == 1 for c in y), "a sum over head groups: one GEMM per group"
            assert len([st for st in s.steps if isinstance(st, Wait)]) == len(peer_pieces(n, g, local_first=True))


def test_merged_pieces_clamp_to_every_peer_and_name_their_blocks():
    for op in MERGED:
        assert build_schedule(op, "flash", 4, 1, peers_per_piece=3).describe() == \
            build_schedule(op, "flash", 4, 1, peers_per_piece=9).describe()
        assert build_schedule(op, "flash", 2, 0, peers_per_piece=5).describe() == \
            build_schedule(op, "flash", 2, 0).describe(), "one peer: nothing to merge"
    assert "compute y[b2-3]" in build_schedule("ag_matmul", "flash", 4, 1, peers_per_piece=2).describe()
    assert "compute p[b1.0/1 g2-3]" in build_schedule("matmul_a2a", "flash", 4, 1, peers_per_piece=2).describe()


@pytest.mark.parametrize("kw, message", [
    (dict(peers_per_piece=0), "peers_per_piece must be an integer >= 1, got 0"),
    (dict(peers_per_piece=1.5), "peers_per_piece must be an integer >= 1, got 1.5"),
    (dict(peers_per_piece=True), "peers_per_piece must be an integer >= 1, got True"),
    (dict(peers_per_piece=2, mode="ring"), "merges the pieces of mode 'flash' only, not of mode 'ring'"),
    (dict(peers_per_piece=2, mode="none"), "merges the pieces of mode 'flash' only, not of mode 'none'"),
    (dict(peers_per_piece=2, chunks=2), "peers_per_piece=2 takes whole blocks: chunks must be 1, got 2"),
    (dict(peers_per_piece=2, op="sharded"), "does not apply to op 'sharded'"),
    (dict(peers_per_piece=2, op="sharded_bwd"), "does not apply to op 'sharded_bwd'"),
])
def test_bad_peers_per_piece_is_named_in_one_line(kw, message):
    kw = dict(op="ag_matmul", mode="flash", chunks=1) | kw
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        build_schedule(kw.pop("op"), kw.pop("mode"), 4, 0, **kw)
    assert "\n" not in str(err.value)
