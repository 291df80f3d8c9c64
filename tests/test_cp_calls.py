"""What the cost model charges a rank's attention (``flashpar.cp.calls``) against what the runtime runs: the tasks of
``flashpar.cp.layout.rank_layout`` and the batches ``flashpar.cp.kernels.make_batches`` forms of them."""

from __future__ import annotations

import random

import numpy as np
import pytest

from flashpar.cp import STRATEGIES, CostModel, calls, plan
from flashpar.cp.cp_plan import rank_figures
from flashpar.cp.ladder import padded_len, padded_lens
from flashpar.cp.layout import rank_layout
from flashpar.cp.lengths import resolve_lengths
from test_cp_kernels import _tasks_of


def _packs():
    """Real packs (few long documents, many short ones) and random ones with lengths on and off the ladder."""
    out = [(resolve_lengths(name).packs(32768, 1)[0], n) for name, n in (("wlbllm", 4), ("sotu", 8))]
    rng = random.Random(0)
    for _ in range(16):
        out.append(([rng.choice([1, 3, 9, 20, 41, 100, 300, 2100, 2500, 7000]) for _ in range(rng.randint(1, 30))],
                    rng.randint(1, 8)))
    return out


def _batches(p, r) -> int:
    return sum(len(phase) for phase in rank_layout(p, r).phases)


def test_ladder_on_arrays_equals_the_scalar_ladder():
    n = np.arange(0, 70000)
    assert padded_lens(n).tolist() == [padded_len(int(x)) for x in n]


def test_calls_are_the_batches_make_batches_forms():
    """Every strategy's plan: the figures' kernel calls per rank are exactly the batches of the rank's layout
    (listing the full tasks), and the lower bound used past ``EXACT_TASKS`` tasks is at most that and at least half
    of it here.  ``torch_per_doc`` keeps its pieces out of token order (a query piece reads several runs of one
    buffer, each a task and a batch layer of its own): there the count is a lower bound."""
    below = 0
    for lens, n in _packs():
        for strategy in STRATEGIES:
            p = plan(lens, n, strategy=strategy)
            want = [_batches(p, r) for r in range(n)]
            got = p.figures().calls
            if strategy == "torch_per_doc":
                assert all(g <= w for g, w in zip(got, want, strict=True)), (strategy, n, lens)
                below += got != want
                continue
            assert got == want, (strategy, n, lens)
            bound = _with_exact_tasks(-1, lambda: p.figures().calls)  # noqa: B023
            assert all(w / 2 <= b <= g for b, g, w in zip(bound, got, want, strict=True)), (strategy, n, bound, want)
    assert below > 0  # (the case the docstring names exists)


def _with_exact_tasks(limit: int, fn):
    old = calls.EXACT_TASKS
    calls.EXACT_TASKS = limit
    try:
        return fn()
    finally:
        calls.EXACT_TASKS = old


@pytest.mark.parametrize("strategy", ["flashcp", "headtail", "contiguous", "per_doc"])
def test_attention_time_is_each_tasks_at_its_shape_and_a_launch_per_batch(strategy):
    """Attention alone (no linear work): a rank's compute is the sum over its layout's tasks of ``attn_time(pairs,
    Lq, Lk)`` at each task's own shape, and one launch per batch; its remote part those of the tasks and batches on
    other ranks' K/V.  The figures sum the full tasks in closed form (``CostModel.full_attn_time``): the same sum in
    another order (rel 1e-12)."""
    cost = CostModel(linear=False)
    lens = resolve_lengths("wlbllm").packs(65536, 1)[0]
    p = plan(lens, 4, strategy=strategy, cost=cost)
    fig = rank_figures(p.segments, p.doc_lens, p.doc_starts, cost, p.comm)
    cut = 0
    for r in range(4):
        local = remote = 0.0
        for phase_id, phase in enumerate(rank_layout(p, r).phases):
            t = len(phase) * cost.hardware.gemm_overhead_s
            for b in phase:
                for q0, q1, k0, k1, causal in _tasks_of(b):
                    lq, lk = q1 - q0, k1 - k0
                    t += cost.attn_time(lq * (lq + 1) // 2 if causal else lq * lk, lq, lk)
                    cut += not causal
            if phase_id == 0:
                local += t
            else:
                remote += t
        assert fig.compute[r] == pytest.approx(local + remote, rel=1e-12)
        assert fig.remote[r] == pytest.approx(remote, rel=1e-12, abs=1e-18)
        assert fig.launch[r] == fig.calls[r] * cost.hardware.gemm_overhead_s
    assert cut > 0  # (full tasks were charged)


def test_a_training_step_weighs_a_launch_two_thirds_of_a_forward():
    """``per_step``: forward and backward each launch every call once, against the linears' 3x."""
    cost = CostModel()
    assert cost.per_step().hardware.gemm_overhead_s == pytest.approx(cost.hardware.gemm_overhead_s * 2 / 3)


def test_full_tasks_in_closed_form_equal_their_sum():
    cost = CostModel()
    for length, keys in ((1, [1]), (700, [3, 900, 20000]), (5000, [5000] * 7)):
        want = sum(cost.attn_time(length * h, length, h) for h in keys)
        assert cost.full_attn_time(length, sum(keys), len(keys)) == pytest.approx(want, rel=1e-12)
        assert float(cost.full_attn_times(np.array([length]), np.array([sum(keys)]), np.array([len(keys)]))[0]) == \
            cost.full_attn_time(length, sum(keys), len(keys))
    assert cost.full_attn_time(100, 0, 0) == 0.0 and cost.piece_attn_time(0, 5, 1) == 0.0
