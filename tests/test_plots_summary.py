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
