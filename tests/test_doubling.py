"""The all-gather and reduce-scatter of ``flashpar.overlap.doubling``: the step pattern played out for every group
size up to 17 in one process (what each position holds after every step), then the real transfers on 1 to 4
gloo ranks against the float64 collectives they replace, two of them in flight at once on one group."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_ranks
from flashpar.overlap import doubling


@pytest.mark.parametrize("n", range(1, 18))
def test_the_gather_steps_bring_every_chunk_once_in_rotated_order(n):
    held = [[{r} if j == 0 else None for j in range(n)] for r in range(n)]  # rank r, position j: the chunks there
    steps = [doubling.gather_steps(n, r) for r in range(n)]
    assert all(len(s) == math.ceil(math.log2(n)) if n > 1 else not s for s in steps)
    for k in range(len(steps[0])):
        sent = {}
        for r in range(n):
            to, count, _, _ = steps[r][k]
            assert all(held[r][j] is not None for j in range(count)), (n, r, k)  # sends only what it holds
            sent[(r, to)] = [set(held[r][j]) for j in range(count)]
        for r in range(n):
            _, count, src, at = steps[r][k]
            got = sent.pop((src, r))
            assert len(got) == count
            for j, chunk in enumerate(got):
                assert held[r][at + j] is None, (n, r, k)  # nothing is overwritten
                held[r][at + j] = chunk
        assert not sent  # every send met its receive
    for r in range(n):
        assert held[r] == [{(r + j) % n} for j in range(n)], (n, r)


@pytest.mark.parametrize("n", range(1, 18))
def test_the_scatter_steps_sum_every_contribution_once(n):
    # rank r, position j: the multiset of (contributing rank, section) summed there so far
    held = [[{(r, (r + j) % n): 1} for j in range(n)] for r in range(n)]
    steps = [doubling.scatter_steps(n, r) for r in range(n)]
    for k in range(len(steps[0])):
        sent = {}
        for r in range(n):
            to, count, _, at = steps[r][k]
            sent[(r, to)] = [held[r][at + j] for j in range(count)]
            for j in range(count):
                held[r][at + j] = None  # sent away: never read again
        for r in range(n):
            _, count, src, _ = steps[r][k]
            for j, part in enumerate(sent.pop((src, r))):
                assert held[r][j] is not None and part is not None, (n, r, k)
                merged = dict(held[r][j])
                for key, c in part.items():
                    merged[key] = merged.get(key, 0) + c
                held[r][j] = merged
        assert not sent
    for r in range(n):
        assert held[r][0] == {(p, r): 1 for p in range(n)}, (n, r)  # every rank's section for r, exactly once


def _collectives(rank: int, world: int) -> str | None:
    """Two all-gathers and two reduce-scatters in flight at once on one group (uneven contents, float64) against
    the backend's collectives on the full tensors; then a buffer of the wrong size."""
    g = torch.Generator().manual_seed(7)
    chunk = 5
    mine = [torch.randn(world, chunk, generator=g, dtype=torch.float64) for _ in range(2)]  # row r: rank r's chunk
    grads = [torch.randn(world, world * chunk, generator=g, dtype=torch.float64) for _ in range(2)]  # row r: rank r's
    group = dist.new_group(list(range(world)))
    errors = []
    bufs, works = [], []
    for m in mine:
        buf = torch.empty(world * chunk, dtype=torch.float64)
        buf[:chunk] = m[rank]
        works.append(doubling.post_all_gather(buf, chunk, group))
        bufs.append(buf)
    outs = []
    for gr in grads:
        send = gr[rank].view(world, chunk).roll(-rank, dims=0).reshape(-1).clone()  # rotated: position j -> rank+j
        out = torch.empty(chunk, dtype=torch.float64)
        works.append(doubling.post_reduce_scatter(send, out, group))
        outs.append(out)
    for w in works:
        w.wait()
    for m, buf in zip(mine, bufs, strict=True):
        want = m.roll(-rank, dims=0).reshape(-1)
        if not torch.equal(buf, want):  # copies only: bit for bit
            errors.append(f"all-gather off by {(buf - want).abs().max():.1e}")
    for gr, out in zip(grads, outs, strict=True):
        want = gr.view(world, world, chunk)[:, rank].sum(0)
        # float64 sums of <= 4 terms in another order: ~1e-16 relative
        if not torch.allclose(out, want, rtol=1e-12, atol=1e-12):
            errors.append(f"reduce-scatter off by {(out - want).abs().max():.1e}")
    try:
        doubling.post_all_gather(torch.empty(world * chunk + 1, dtype=torch.float64), chunk, group)
        errors.append("a buffer of the wrong size was accepted")
    except ValueError as err:
        if "buffer" not in str(err):
            errors.append(f"unclear error: {err}")
    return "; ".join(errors) or None


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_doubling_collectives_match_the_backends_on_gloo(n):
    assert run_ranks(n, _collectives) == [None] * n
