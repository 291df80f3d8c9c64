"""``flashpar train --plot``: the loss curve and the per-rank work of the last step's context-parallel plan.

Left: loss per step (and, with ``--eval-every``, the validation loss of the held-out documents).
Right: when each cp rank's compute ends in the cost model (``CostModel.compute_ends`` of
``CPPlan.stats()["compute"]``, ms: ranks that share cores speed up as others end) for the run's
strategy and, on the same documents, ``per_doc`` and ``headtail``; each strategy's estimated step time is
in its legend entry and is a dashed line in its colour, in the bars' unit (the legend sits below the
panel, over no bar).  A step waits for the slowest rank's compute plus the K/V transfers it cannot hide,
so a strategy with a taller bar can still have the shorter step; the title gives the whole run's ratio
(the figure ``flashpar train`` prints: the estimated step times summed over the steps).  Needs matplotlib
(``pip install 'flashpar[plot]'``).
"""

from __future__ import annotations

from pathlib import Path

from flashpar import cp


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(history: list[dict], plan, path: Path) -> None:
    """Write the figure (``figure``) to ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(history, plan)
    fig.savefig(path)
    plt.close(fig)


def figure(history: list[dict], plan):
    """The two panels of the module docstring (a matplotlib figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot([r["step"] for r in history], [r["loss"] for r in history], label="training")
    evals = [r for r in history if r.get("eval_loss") is not None]
    if evals:  # --eval-every: the held-out documents' loss
        ax1.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="validation (held out)")
        ax1.legend()
    ax1.set(xlabel="step", ylabel="loss (next token, nats)", title="training and validation loss" if evals else
            "training loss")
    strategies = [plan.strategy] + [s for s in ("per_doc", "headtail") if s != plan.strategy]
    n, width = plan.cp_size, 0.8 / len(strategies)
    top = 0.0
    for i, s in enumerate(strategies):
        p = plan if s == plan.strategy else cp.plan(plan.doc_lens, n, strategy=s, cost=plan.cost)
        stats = p.stats()
        step_ms = 1e3 * stats["est_step_time"]
        ends = p.cost.compute_ends(stats["compute"])  # ranks sharing cores: a rank speeds up once others end
        bars = ax2.bar([r + i * width for r in range(n)], [1e3 * t for t in ends], width,
                       label=f"{s}: step {step_ms:.3g} ms")
        # the step in the bars' unit, over the strategy's own bars: no bar stands above its step's line
        ax2.hlines(step_ms, -width / 2, n - 1 + (len(strategies) - 0.5) * width, colors=bars[0].get_facecolor(),
                   linestyles="--", linewidth=1)
        top = max(top, step_ms, 1e3 * max(ends))
    ax2.set_ylim(0, 1.05 * top)
    ax2.set_xticks([r + (len(strategies) - 1) * width / 2 for r in range(n)], [str(r) for r in range(n)])
    docs = len(plan.doc_lens)
    run = run_ratio(history, plan.strategy)
    ax2.set(xlabel="cp rank", ylabel="compute ends, cost model (ms)",
            title=f"last step's plan: {docs} document{'s' if docs != 1 else ''}{run}")
    ax2.legend(title="estimated step, dashed (compute + exposed K/V)", fontsize="small", title_fontsize="small",
               loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(strategies))  # below: it hides no bar
    fig.tight_layout()
    return fig


def run_ratio(history: list[dict], strategy: str) -> str:
    """``"; run: 1.05x per_doc's step"``: per_doc's estimated step time over the strategy's, summed over the
    run's steps (what ``flashpar train`` prints); "" when the rows lack them or the strategy is per_doc."""
    if strategy == "per_doc" or not history or any("per_doc_est_step_ms" not in r for r in history):
        return ""
    ours = sum(r["est_step_ms"] for r in history)
    return f"; run: {sum(r['per_doc_est_step_ms'] for r in history) / max(ours, 1e-12):.2f}x per_doc's step"
