"""``flashpar train --plot``: the loss curve and the per-rank work of the last step's context-parallel plan.

Left: loss per step (and, with ``--eval-every``, the validation loss of the held-out documents).
Right: each cp rank's compute in the cost model (``CPPlan.stats()["compute"]``)
for the run's strategy and, on the same documents, ``per_doc`` and ``headtail``; the step waits for
the busiest rank.  Needs matplotlib (``pip install 'flashpar[plot]'``).
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
    for i, s in enumerate(strategies):
        p = plan if s == plan.strategy else cp.plan(plan.doc_lens, n, strategy=s, cost=plan.cost)
        ax2.bar([r + i * width for r in range(n)], [1e6 * t for t in p.stats()["compute"]], width, label=s)
    ax2.set_xticks([r + (len(strategies) - 1) * width / 2 for r in range(n)], [str(r) for r in range(n)])
    ax2.set(xlabel="cp rank", ylabel="compute, cost model (us)",
            title=f"last step's plan: {len(plan.doc_lens)} documents")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
