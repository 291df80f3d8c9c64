"""The figures and summary.json of ``flashpar train`` / ``flashpar plan``: names that say what they hold, integer
rank ticks, and a right panel that carries the numbers the run's text states."""

from __future__ import annotations

import pytest

from flashpar import cp
from flashpar.train.config import TrainConfig
from flashpar.train.metrics import StepMetrics, summary

pytest.importorskip("matplotlib")

DOCS = [700, 90, 1500, 40, 300, 2000, 10, 456]


def _row(step: int, est: float, per_doc: float) -> dict:
    plan = {"est_step_ms": est, "plan_kv_bytes": 10.0, "exposed_comm_ms_est": 0.0, "per_doc_kv_bytes": 20.0,
            "per_doc_est_step_ms": per_doc, "headtail_kv_bytes": 30.0, "headtail_est_step_ms": per_doc + 1}
    return StepMetrics(step=step, loss=2.0, step_s=0.5, tokens_per_s=100.0, model_flops_per_s=1e9, mfu=0.1,
                       kv_bytes=5, planning_ms_dp0=1.0, plan=plan, lr=1e-3, grad_norm=1.0)


def test_summary_step_times_are_per_step_means_and_bytes_are_totals():
    s = summary([_row(1, 1.0, 2.0), _row(2, 3.0, 4.0)], 1.0, TrainConfig(steps=2), 1e9)
    assert (s["est_step_ms"], s["per_doc_est_step_ms"], s["headtail_est_step_ms"]) == (2.0, 3.0, 4.0)
    assert (s["plan_kv_bytes"], s["per_doc_kv_bytes"], s["kv_bytes"]) == (20.0, 40.0, 10)


def test_plan_plot_ticks_one_integer_per_rank():
    from flashpar.cp.cli import plan_figure

    fig = plan_figure(cp.plan(DOCS, 3, strategy="flashcp"))
    left, right = fig.axes[:2]
    for axis in (left.xaxis, right.xaxis, right.yaxis):
        assert list(axis.get_ticklocs()) == [0, 1, 2]
        assert [t.get_text() for t in axis.get_ticklabels()] == ["0", "1", "2"]


def test_train_plot_states_each_strategys_step_and_the_runs_ratio():
    from flashpar.train.report import figure

    plan = cp.plan(DOCS, 2, strategy="flashcp")
    fig = figure([r.row() for r in (_row(1, 1.0, 1.5), _row(2, 1.0, 0.6))], plan)
    right = fig.axes[1]
    labels = [t.get_text() for t in right.get_legend().get_texts()]
    want = {s: 1e3 * (plan if s == "flashcp" else cp.plan(DOCS, 2, strategy=s, cost=plan.cost)).stats()[
        "est_step_time"] for s in ("flashcp", "per_doc", "headtail")}
    assert labels == [f"{s}: step {ms:.3g} ms" for s, ms in want.items()], labels
    assert right.get_title() == "last step's plan: 8 documents; run: 1.05x per_doc's step", right.get_title()
    # the bars in the step's unit (ms), none above its strategy's dashed step line, the legend outside the axes
    lines = [c.get_segments()[0][0][1] for c in right.collections]
    assert lines == pytest.approx(list(want.values()))
    bars = [b.get_height() for b in right.patches]
    for k, step_ms in enumerate(want.values()):
        assert max(bars[2 * k:2 * k + 2]) <= step_ms * (1 + 1e-9)
    assert right.get_ylim()[1] >= max(bars + lines)
    fig.canvas.draw()
    legend, axes = right.get_legend().get_window_extent(), right.get_window_extent()
    assert legend.y1 <= axes.y0, (legend, axes)  # below the panel: it covers no bar


def test_ranks_sharing_cores_end_their_compute_by_the_step():
    """4 ranks on 2 cores (burst 2): the rank with less work ends first and the other speeds up, so a rank's
    nominal compute (35 ms against a 25 ms step in the default run's plot) is not when it ends.  The bars are the
    ends: none above the step's dashed line; the ends equal an event-by-event processor-sharing walk."""
    from flashpar.models import LlamaConfig
    from flashpar.train.planning import planner_cost
    from flashpar.train.report import figure

    cost = planner_cost(LlamaConfig(), 4, burst=2.0)
    plan = cp.plan([2048], 2, strategy="flashcp", cost=cost)
    stats = plan.stats()
    assert max(stats["compute"]) > stats["est_step_time"]  # the case: nominal compute over the step
    fig = figure([_row(1, 1.0, 1.1).row()], plan)
    right = fig.axes[1]
    step_ms = right.collections[0].get_segments()[0][0][1]
    assert step_ms == pytest.approx(1e3 * stats["est_step_time"])
    assert max(b.get_height() for b in right.patches[:2]) <= step_ms * (1 + 1e-9)


@pytest.mark.parametrize("burst", [1.0, 1.5, 2.0, 4.0])
def test_compute_ends_walk_the_shared_cores_event_by_event(burst):
    import random

    from flashpar.models import LlamaConfig
    from flashpar.train.planning import planner_cost

    cost = planner_cost(LlamaConfig(), 4, burst=burst)
    rng = random.Random(int(burst * 10))
    for n in (1, 2, 3, 5):
        work = [rng.choice([rng.uniform(0.1, 2.0), 1.0]) for _ in range(n)]  # ties included
        # the walk: every unfinished rank advances at min(burst, n / busy) of its all-busy rate
        left, ends, now = dict(enumerate(work)), [0.0] * n, 0.0
        while left:
            rate = min(burst, n / len(left))
            first = min(left.values())
            now += first / rate
            for r in list(left):
                left[r] -= first
                if left[r] <= 1e-12:
                    ends[r] = now
                    del left[r]
        assert list(cost.compute_ends(work)) == pytest.approx(ends, rel=1e-12)
        assert max(ends) == pytest.approx(cost.compute_span(work), rel=1e-12)
