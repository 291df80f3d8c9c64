"""The hybrid search (:func:`flashcp`): greedy passes over a grid of knobs (:mod:`.policy`), the baselines' placements
beside them, each scored by the cost model's estimated step time; the pick is the fewest K/V among the fastest
(:mod:`.pick`), never estimated slower than any baseline.  Also the ``whole_doc`` baseline (:func:`whole_doc`)."""

from __future__ import annotations

import functools
import math

from flashpar.cp.cost import CostModel
from flashpar.cp.cp_plan import whole_doc_times
from flashpar.cp.flashcp.bounds import cut_all_bound, per_doc_bound, ring_bound, whole_doc_bound
from flashpar.cp.flashcp.greedy import Greedy
from flashpar.cp.flashcp.pick import PERFECT, TIME_TIE, balanced, pick, unique_placements
from flashpar.cp.flashcp.policy import Policy
from flashpar.cp.flashcp.work import token_cap
from flashpar.cp.strategies import ArrayPlacement, contiguous, headtail, per_doc_arrays, torch_per_doc


def whole_doc(doc_lens: list[int], n: int, cost: CostModel, token_slack: float, lens_np=None) -> ArrayPlacement:
    """Baseline: Whole-Doc wherever a document fits under the token cap, Per-Doc for the rest (``lens_np``: the
    lengths as an int64 array, where the caller has it)."""
    cap = token_cap(doc_lens, n, token_slack, None if lens_np is None else int(lens_np.sum()))
    return Greedy(doc_lens, n, cost, cap, lens_np).run(float("inf"), 0, subgroups=False)


def plan(doc_lens: list[int], n: int, cost: CostModel, token_slack: float, lens_np=None) -> ArrayPlacement:
    """The hybrid search (see the module docstring); ``lens_np``: ``doc_lens`` as an int64 array, where the caller
    has it."""
    cap = token_cap(doc_lens, n, token_slack, None if lens_np is None else int(lens_np.sum()))
    # attention alone: balance the attention work itself (pairs, no launches), as the solvers it is compared with do
    policy = Policy.for_ranks(n)
    pairs_only = cost.with_hardware(attn_half=0.0, gemm_overhead_s=0.0)
    greedy = Greedy(doc_lens, n, cost if cost.linear else pairs_only, cap, lens_np)
    starts = greedy.starts_np
    lower = greedy.mean  # no plan's step time is below the mean compute of every document whole (cuts only add)
    first = greedy.calibrate()  # the pass (tol 0, force 0, share 1), where the mean did not move
    @functools.cache
    def whole() -> ArrayPlacement:  # the whole_doc baseline: planned once, where it can matter (see scored)
        # as the whole_doc strategy plans it: with the mean of every document whole, not the calibrated one
        calibrated, greedy.mean = greedy.mean, lower
        try:
            return greedy.run(float("inf"), 0, subgroups=False)
        finally:
            greedy.mean = calibrated

    ring_of = functools.cache(lambda: [f(doc_lens, n, starts) for f in (headtail, contiguous)])
    # per_doc, and torch_per_doc where the grid has it; in the order the baselines are compared in
    cut_all = lambda: ([per_doc_arrays(doc_lens, n)],  # noqa: E731
                       [ArrayPlacement.of(torch_per_doc(doc_lens, n, False))] if policy.torch_per_doc else [])
    fig_of: dict[bytes, object] = {}
    times = greedy.whole_times()
    if greedy.cost is not cost:  # (attention alone: the greedy's cost differs; each length's, per document)
        times = (greedy.lens_np, whole_doc_times(greedy.distinct, cost)[greedy.doc_run])
    ring_low = functools.cache(lambda: ring_bound(greedy.lens_np, starts, n, cost, times[1]))
    runs = (greedy.distinct, greedy.doc_run)

    def scored(candidates: list[ArrayPlacement]):
        """The pick among ``candidates`` and the baselines (see pick), and its figures."""
        for p in unique_placements(candidates):
            if p.key() not in fig_of:
                fig_of[p.key()] = p.figures(doc_lens, starts, cost, whole=times)
        # headtail and contiguous: neither planned nor scored where their lower bound (ring_bound) is slower than
        # the fastest candidate within the cap by more than a tie (as per_doc below: neither could be the fastest,
        # tie, nor lower the baselines' bound, nor change the skips below, which compare with that fastest), unless
        # one might equal another placement (as many pieces as one): then in their places in the order
        inside = [fig_of[p.key()].step for p in candidates if max(fig_of[p.key()].tokens) <= cap]
        ring, pieces = None, ()
        if inside:
            low, pieces = ring_low()
            if low > min(inside) * (1 + TIME_TIE):
                ring = []
        ring = ring_of() if ring is None else ring
        for p in ring:
            if p.key() not in fig_of:
                fig_of[p.key()] = p.figures(doc_lens, starts, cost, whole=times)
        # the whole_doc baseline (a greedy pass of its own): skipped where its lower bound (whole_doc_bound)
        # is slower than the fastest of the rest within the cap by more than a tie, as per_doc below
        rest = [fig_of[p.key()].step for p in candidates + ring if max(fig_of[p.key()].tokens) <= cap]
        wd = []
        if not rest or whole_doc_bound(greedy.lens_np, n, cost, cap, times[1]) <= min(rest) * (1 + TIME_TIE):
            wd = [whole()]
            if wd[0].key() not in fig_of:
                fig_of[wd[0].key()] = wd[0].figures(doc_lens, starts, cost, whole=times)
        # per_doc and torch_per_doc cut every document into 2N pieces (O(D N) of them): skipped where even
        # their lower bound (see cut_all_bound) is slower than the fastest candidate within the cap by more
        # than a tie, which leaves the choice as it was (such a candidate can be neither the fastest nor tied,
        # and its time cannot lower the bound the baselines set)
        pool = [fig_of[p.key()].step for p in candidates + [*wd, *ring] if max(fig_of[p.key()].tokens) <= cap]
        pd, tpd = [], []
        if not pool or cut_all_bound(greedy.lens_np, n, cost, runs) <= min(pool) * (1 + TIME_TIE):
            pd, tpd = cut_all()
            if pool and per_doc_bound(greedy.lens_np, n, cost, runs) > min(pool) * (1 + TIME_TIE):
                pd = []  # (per_doc's own bound, with its tasks and launches, is slower than a tie)
            for p in pd + tpd:
                if p.key() not in fig_of:
                    fig_of[p.key()] = p.figures(doc_lens, starts, cost, whole=times)
        if not ring and any(len(p.a) in pieces for p in candidates + wd + pd + tpd):
            ring = ring_of()
            for p in ring:
                if p.key() not in fig_of:
                    fig_of[p.key()] = p.figures(doc_lens, starts, cost, whole=times)
        baselines = [*wd, *pd, *ring, *tpd]
        unique = unique_placements(candidates + baselines)
        keys = {p.key() for p in baselines}
        best = unique[pick([fig_of[p.key()] for p in unique], cap, [p.key() in keys for p in unique], cost)]
        return best, fig_of[best.key()]

    if cost.linear and first is not None:
        fig_of[first[0].key()] = greedy.first_figures
        best, fig = scored([first[0]])
        # nothing left to gain: every document whole at the mean compute (kernel launches aside: the slowest
        # rank's are at most the most any rank makes)
        if sum(fig.recv_tokens) == 0 and fig.step <= (lower + max(fig.launch)) * (1 + PERFECT):
            return best
    forced, tolerances, shares = policy.forced, policy.tolerances, policy.shares  # the grid (see Policy)
    # the longest document fits whole nowhere: forcing it to split changes nothing (past the token cap, by assumption;
    # over the work bound, where the group search places it among the empty ranks, exactly: the same passes twice)
    if int(greedy.lens_np.max()) > cap or (len(forced) > 1 and greedy.forcing_changes_nothing(tolerances, shares)):
        forced = forced[:1]
    candidates, peak = [], {}
    for share in shares:  # a pass whose splits all stayed under a smaller share equals that share's pass
        for force in forced:
            for tol in tolerances:
                if peak.get((force, tol), math.inf) <= share:
                    continue
                if first is not None and (share, force, tol) == (1.0, 0, 0.0):
                    candidates.append(first[0])
                    peak[(force, tol)] = first[1]
                    continue
                candidates.append(greedy.run(tol, force, share))
                peak[(force, tol)] = greedy.peak_share
    if not cost.linear:  # attention alone: balance first (see balanced), then the least time, then K/V
        pd, tpd = cut_all()
        unique = unique_placements(candidates + [whole(), *pd, *ring_of(), *tpd])
        figs = {i: unique[i].figures(doc_lens, starts, cost, whole=times)
                for i in balanced(unique, starts, cap, cost.window)}
        return unique[min(figs, key=lambda i: (figs[i].step, sum(figs[i].recv_tokens), i))]
    return scored(candidates)[0]

