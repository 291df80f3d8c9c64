"""ZeRO-3 by prefetch (``flashpar.overlap.prefetch``, ``flashpar.overlap.unit``) on gloo: meshes (dp, tp) of 1 to 4
ranks, every schedule (blocking, one and two units ahead, the last unit kept, activation checkpointing), against
the float64 single-process model; the order of the lanes; nothing gathered outlives its unit's forward."""

from __future__ import annotations

import pytest

from dist_harness import SpawnCache
from prefetch_workers import LAYERS, MESHES, SCHEDULES, reference_cases


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(lambda n: [("reference", reference_cases)])


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_prefetched_units_match_float64_reference_every_mesh_and_schedule(spawned, n):
    """Output and every weight shard's gradient (summed over dp, a regrouped member's repeats summed) on every
    (dp, tp) mesh of ``n`` ranks and every schedule: uneven dp rows (3 and 5 rows over 2 and 4 ranks), uneven tp
    blocks, different batch lengths per replica."""
    per_rank = spawned(n)["reference"]
    assert all(len(out) == len(MESHES[n]) * len(SCHEDULES) for out in per_rank)
    bad = {(r, case): err for r, out in enumerate(per_rank) for case, (err, _, _) in out.items() if err}
    assert not bad, bad


# the lanes' posts in backward of one step of the 3 units (forward: gathers 0, 1, 2 in order), by hand: at unit
# k's backward start its own gather-again (unless kept) and the next `depth` units' are posted; its reduce-scatter
# when its gradients are in
BACKWARD = {
    (0, False): ["g2", "s2", "g1", "s1", "g0", "s0"],
    (1, False): ["g2", "g1", "s2", "g0", "s1", "s0"],
    (1, True): ["g1", "s2", "g0", "s1", "s0"],
    (2, True): ["g1", "g0", "s2", "s1", "s0"],
}


@pytest.mark.parametrize("n", [2, 4])
def test_lanes_post_in_unit_order_and_the_kept_unit_is_not_gathered_again(spawned, n):
    assert LAYERS == 3
    for out in spawned(n)["reference"]:
        for case, (_, trace, alive) in out.items():
            depth = int(case.split("depth")[1][0])
            keep_last = case.split("keep")[1][0] == "1"
            posts = [f"{what[0]}{k}" for what, k in trace]
            assert posts == ["g0", "g1", "g2", *BACKWARD[depth, keep_last]], (case, posts)
            kept = {LAYERS - 1} if keep_last else set()
            assert set(alive) <= kept, (case, alive)  # after forward: only the kept unit's buffer is alive
