"""``flashpar simulate check`` on a ``flashpar bench cp --json`` report: every measured ratio, predicted from
the file's calibration alone.

The report holds the calibrated cost models (``fwd_cost``, ``bwd_cost``: ``CostModel.to_dict()``), the
benchmark's ``config`` (lengths, tokens, scale, pack count, cores; the packs are sampled with seed 0, as
``bench/cp.py: _packs`` does) and, per strategy, the measured medians.  The packs are rebuilt from the
config and every strategy re-planned with the forward cost model, exactly as the ranks did (the planner
is deterministic; the rebuilt packs must have the report's document counts, else the check falls back to
the report's own ``pred_*`` figures and says so in every row's ``why``).  Per plan, per direction, the
cost model gives each rank's compute and communication (``rank_figures``), played on the cores the ranks
shared (``bench/cp.py: predict`` and ``shared_finish``).  Compared, as the README's bench cp table
claims them:

    x headtail, x per_doc   baseline step / strategy step, steps summed over the packs
                            (measured: the overlapped forward + backward, median of the slowest rank)
    compute imbalance       max_r / mean_r of each rank's compute-only forward + backward time, mean over
                            packs; predicted with processor sharing (a rank's finish time under
                            ``shared_finish``), which is what a rank measures from the barrier
    sent bytes              K/V bytes sent forward, all ranks, all packs: exact (counted at the transport;
                            the plan's sum of kv_send_bytes)
"""

from __future__ import annotations

BASELINES = ("headtail", "per_doc")  # the README's bench cp table: "x headtail" and "x per_doc"


def _replan(report: dict):
    """``{strategy: [plan per pack]}`` rebuilt from the report, or ``(None, reason)`` when it cannot be."""
    from flashpar.bench.cp import _packs
    from flashpar.cp import CostModel, plan

    config = report.get("config", {})
    missing = [k for k in ("lengths", "tokens", "scale", "packs", "cores") if k not in config]
    if missing:
        return None, f"the report's config lacks {missing}: stored predictions used"
    try:
        packs = _packs(config)
    except (OSError, ValueError) as err:
        return None, f"packs not rebuilt ({err}): stored predictions used"
    if [len(p) for p in packs] != list(report["packs"]):
        return None, "rebuilt packs differ from the report's document counts: stored predictions used"
    fwd = CostModel.from_dict(report["fwd_cost"])
    n = report["world_size"]
    return {s: [plan(lens, n, strategy=s, cost=fwd) for lens in packs] for s in report["rows"]}, ""


def predictions(report: dict) -> tuple[dict, str]:
    """``{strategy: {"step", "imbalance", "bytes"}}`` from the file's calibration, and a note (``""`` when the
    packs were re-planned; else why the stored ``pred_*`` figures stand in, bytes then unknown)."""
    from flashpar.bench.cp import predict, shared_finish
    from flashpar.cp import CostModel
    from flashpar.cp.cp_plan import rank_figures

    plans, note = _replan(report)
    if plans is None:
        return {s: {"step": r["pred_step"], "imbalance": r["pred_imbalance"], "bytes": None}
                for s, r in report["rows"].items()}, note
    fwd, bwd = CostModel.from_dict(report["fwd_cost"]), CostModel.from_dict(report["bwd_cost"])
    cores = report["config"]["cores"]
    out = {}
    for s, ps in plans.items():
        step, imb, sent = 0.0, [], 0
        for p in ps:
            step += predict(p, fwd, bwd, cores)["step"]
            per_rank = [0.0] * p.cp_size
            for cost in (fwd, bwd):  # what a rank measures in the compute-only run: its finish time, shared cores
                fig = rank_figures(p.segments, p.doc_lens, p.doc_starts, cost, p.comm)
                per_rank = [a + b for a, b in zip(per_rank, shared_finish(fig.compute, cores), strict=True)]
            imb.append(max(per_rank) / (sum(per_rank) / len(per_rank)))
            sent += sum(fig.recv_tokens) * fwd.kv_bytes_per_token  # every received token was sent once
        out[s] = {"step": step, "imbalance": sum(imb) / len(imb), "bytes": sent}
    return out, note


def check(report: dict) -> list[dict]:
    rows = report["rows"]
    if not isinstance(rows, dict) or not rows:
        raise ValueError("a bench cp report's rows must be a non-empty object {strategy: figures}")
    pred, note = predictions(report)
    out = []
    for base in BASELINES:
        if base not in rows:
            continue
        for s, r in rows.items():
            if s == base:
                continue
            out.append({"row": s, "figure": f"x {base}", "predicted": pred[base]["step"] / pred[s]["step"],
                        "measured": rows[base]["overlapped"] / r["overlapped"], "why": note})
    for s, r in rows.items():
        out.append({"row": s, "figure": "compute imbalance", "predicted": pred[s]["imbalance"],
                    "measured": r["imbalance"], "why": note})
    for s, r in rows.items():
        if pred[s]["bytes"] is not None:
            out.append({"row": s, "figure": "sent MB (exact)", "predicted": pred[s]["bytes"] / 1e6,
                        "measured": r["bytes"] / 1e6, "exact": True,
                        "why": "" if pred[s]["bytes"] == r["bytes"] else "bytes differ from the plan's count"})
    return out
