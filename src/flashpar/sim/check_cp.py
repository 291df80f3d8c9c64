"""``flashpar simulate check`` on a ``flashpar bench cp --json`` report: every measured ratio, predicted from
the file's calibration alone.

The report holds the calibrated cost models (``fwd_cost``, ``bwd_cost``: ``CostModel.to_dict()``), the
benchmark's ``config`` (lengths, tokens, scale, pack count, cores; the packs are sampled with seed 0 by
``flashpar.sim.bench_runs.cp_packs``, as the benchmark's ranks did) and, per strategy, the measured medians.
The packs are rebuilt from the config and every strategy re-planned with the forward cost model, exactly as
the ranks did (the planner is deterministic; the rebuilt packs must have the report's document counts, else
the check falls back to the report's own ``pred_*`` figures and says so in every row's ``why``).  Per plan,
per direction, the cost model gives each rank's compute and communication (``rank_figures``), played on the
cores the ranks shared (``flashpar.sim.bench_runs.cp_predict`` and ``flashpar.cost.shared_finish``, as the
benchmark predicts).  Compared, as the README's bench cp table claims them:

    x headtail, x per_doc   baseline step / strategy step, steps summed over the packs
                            (measured: the overlapped forward + backward, median of the slowest rank)
    compute imbalance       max_r / mean_r of each rank's compute-only forward + backward time, mean over
                            packs; predicted with processor sharing (a rank's finish time under
                            ``shared_finish``), which is what a rank measures from the barrier
    sent bytes              K/V bytes sent forward, all ranks, all packs: exact (counted at the transport;
                            the plan's sum of kv_send_bytes)

A step ratio that misses by more than 15% is explained (``why``) only where the file shows the reason: the
benchmark also measured each plan compute-only and communication-only, and the model predicts both parts
(compute-only: max over ranks of the shared-core finish times, forward + backward; comm-only: max over ranks
of the K/V time).  When measured / predicted of a part differs between the strategy and its baseline by
more than 15%, the step model was fed a part that is already off, and ``why`` gives both parts' ratios.
Likewise a compute imbalance that misses is explained only where the per-rank compute-only times (kept per
pack in the report) show the model's busiest rank and the other ranks off by factors more than 15% apart.
"""

from __future__ import annotations

from flashpar.sim.check import TOLERANCE

BASELINES = ("headtail", "per_doc")  # the README's bench cp table: "x headtail" and "x per_doc"


def _parts_off(pred: dict, rows: dict, s: str, base: str) -> str:
    """Why a step ratio of ``s`` over ``base`` misses, when the measured parts show it (module docstring): the
    measured / predicted compute-only and comm-only steps of both, if one part's differs by more than 15%."""
    if "compute" not in pred[s] or any(part not in rows[x] for part in ("compute", "comm") for x in (s, base)):
        return ""
    off = {part: (rows[s][part] / pred[s][part] if pred[s][part] else float("nan"),
                  rows[base][part] / pred[base][part] if pred[base][part] else float("nan"))
           for part in ("compute", "comm")}
    if not any(abs(a / b - 1) > TOLERANCE for a, b in off.values() if a == a and b == b):  # NaN: no such part
        return ""
    parts = "; ".join(f"{part}-only measured/predicted {a:.2f} vs {b:.2f}" for part, (a, b) in off.items()
                      if a == a and b == b)
    return f"the model's parts already miss ({s} vs {base}): {parts}"


def _ranks_off(pred: dict, row: dict) -> str:
    """Why a compute imbalance misses, when the file's per-rank compute-only times show it: per pack, measured /
    predicted of the rank the model makes busiest against that of the other ranks together; the pack where
    they differ most, if by more than 15%."""
    packs = row.get("per_pack")
    if "ranks" not in pred or not packs or any("rank_compute_fwd" not in x for x in packs):
        return ""
    worst = None
    for i, (predicted, x) in enumerate(zip(pred["ranks"], packs, strict=True)):
        measured = [f + b for f, b in zip(x["rank_compute_fwd"], x["rank_compute_bwd"], strict=True)]
        busy = max(range(len(predicted)), key=predicted.__getitem__)
        rest = [r for r in range(len(predicted)) if r != busy]
        a = measured[busy] / predicted[busy]
        b = sum(measured[r] for r in rest) / sum(predicted[r] for r in rest)
        if worst is None or abs(a / b - 1) > abs(worst[1] / worst[2] - 1):
            worst = (i, a, b, busy)
    i, a, b, busy = worst
    if abs(a / b - 1) <= TOLERANCE:
        return ""
    return (f"per-rank compute-only measured/predicted, pack {i}: {a:.2f} on the busiest rank ({busy}), {b:.2f} on the "
            "others: the model's per-rank compute is off unequally")


def _replan(report: dict):
    """``{strategy: [plan per pack]}`` rebuilt from the report, or ``(None, reason)`` when it cannot be."""
    from flashpar.cp import CostModel, plan
    from flashpar.sim.bench_runs import cp_packs

    config = report.get("config", {})
    missing = [k for k in ("lengths", "tokens", "scale", "packs", "cores") if k not in config]
    if missing:
        return None, f"the report's config lacks {missing}: stored predictions used"
    try:
        packs = cp_packs(config)
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
    from flashpar.cost import shared_finish
    from flashpar.cp import CostModel
    from flashpar.cp.cp_plan import rank_figures
    from flashpar.sim.bench_runs import cp_predict

    plans, note = _replan(report)
    if plans is None:
        return {s: {"step": r["pred_step"], "imbalance": r["pred_imbalance"], "bytes": None}
                for s, r in report["rows"].items()}, note
    fwd, bwd = CostModel.from_dict(report["fwd_cost"]), CostModel.from_dict(report["bwd_cost"])
    cores = report["config"]["cores"]
    out = {}
    for s, ps in plans.items():
        step, imb, sent, compute, comm, ranks = 0.0, [], 0, 0.0, 0.0, []
        for p in ps:
            step += cp_predict(p, fwd, bwd, cores)["step"]
            per_rank, per_rank_comm = [0.0] * p.cp_size, [0.0] * p.cp_size
            for cost in (fwd, bwd):  # what a rank measures in the compute-only run: its finish time, shared cores
                fig = rank_figures(p.segments, p.doc_lens, p.doc_starts, cost, p.comm)
                per_rank = [a + b for a, b in zip(per_rank, shared_finish(fig.compute, cores), strict=True)]
                per_rank_comm = [a + b for a, b in zip(per_rank_comm, fig.comm, strict=True)]
            imb.append(max(per_rank) / (sum(per_rank) / len(per_rank)))
            ranks.append(per_rank)
            compute += max(per_rank)
            comm += max(per_rank_comm)
            sent += sum(fig.recv_tokens) * fwd.kv_bytes_per_token  # every received token was sent once
        out[s] = {"step": step, "imbalance": sum(imb) / len(imb), "bytes": sent, "compute": compute, "comm": comm,
                  "ranks": ranks}
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
            predicted, measured = pred[base]["step"] / pred[s]["step"], rows[base]["overlapped"] / r["overlapped"]
            why = note or (_parts_off(pred, rows, s, base) if abs(predicted / measured - 1) > TOLERANCE else "")
            out.append({"row": s, "figure": f"x {base}", "predicted": predicted, "measured": measured, "why": why})
    for s, r in rows.items():
        predicted, measured = pred[s]["imbalance"], r["imbalance"]
        why = note or (_ranks_off(pred[s], r) if abs(predicted / measured - 1) > TOLERANCE else "")
        out.append({"row": s, "figure": "compute imbalance", "predicted": predicted, "measured": measured,
                    "why": why})
    for s, r in rows.items():
        if pred[s]["bytes"] is not None:
            out.append({"row": s, "figure": "sent MB (exact)", "predicted": pred[s]["bytes"] / 1e6,
                        "measured": r["bytes"] / 1e6, "exact": True,
                        "why": "" if pred[s]["bytes"] == r["bytes"] else "bytes differ from the plan's count"})
    return out
