"""``flashpar simulate check`` on a ``flashpar bench overlap --json`` report: every measured row predicted.

The report (one world size, or a list of them as ``--nproc 2,4`` writes) holds the calibration the run
measured (``hardware``: GEMM rate and small-M curve, per-piece and per-lane-item overheads, link, and the
CPU a transfer takes from the compute beside it, ``comm_cpu_s_per_byte``, 0 in reports older than it, with
its spread in ``comm_cpu``) and, per
shape and mode, the medians of the slowest rank: ``compute`` (communication made free), ``comm``
(computation made free) and ``overlapped``, forward and backward, with each round's slowest-rank time of each
(``samples``; reports older than them have none).  Each row is predicted from that
calibration alone, on the schedule the run executed (``build_schedule`` of rank 0 on equal blocks, without
a bias as the benchmark's ops have none, timed by :func:`flashpar.overlap.simulate.simulate`; ``auto`` with
the pick the run recorded), and two ratios are compared per direction:

    ovl/ideal   overlapped / max(compute, comm)          (how much of the shorter side is hidden)
    vs none     overlapped / overlapped of none          (what the mode buys)

``none``'s own ``vs none`` is 1 by definition and is not a row.  Each row also holds ``from_parts``: the
same ratio from the same schedules timed on the run's own compute-only and comm-only figures
(:func:`_rescaled`), which separates the overlap model from the calibration.  A miss (more than 15%) carries
a ``why`` only when the report itself shows the cause (see :func:`_why`); otherwise it stays unexplained.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from flashpar.cost import Hardware

ELEM_BYTES = {"float32": 4, "bfloat16": 2}
TOLERANCE = 0.15  # flashpar.sim.check.TOLERANCE (not imported: check imports this module)


def check(report) -> list[dict]:
    """Rows ``{"row", "figure", "predicted", "measured", "from_parts", "why"}`` of every report in ``report``."""
    reports = report if isinstance(report, list) else [report]
    rows = []
    for rep in reports:
        rows += _check_one(rep)
    return rows


def _check_one(report: dict) -> list[dict]:
    from flashpar.sim.bench_runs import BenchShape

    n = int(report["world_size"])
    hw = Hardware(**report["hardware"])
    elem = ELEM_BYTES.get(report.get("dtype", "float32"))
    if elem is None:
        raise ValueError(f"unknown dtype {report.get('dtype')!r} in the report; expected one of {tuple(ELEM_BYTES)}")
    bounds = _comm_cpu_bounds(report.get("comm_cpu"))
    out = []
    for entry in report["shapes"]:
        shape = BenchShape(**entry["shape"])
        sim_op, *dims = shape.sim_args(n)
        modes = entry["modes"]
        none = next((m for m in modes if m["mode"] == "none"), None)
        for d, (direction, short) in enumerate((("forward", "fwd"), ("backward", "bwd"))):
            op = sim_op if d == 0 else f"{sim_op}_bwd"
            pred = {id(m): _predict(op, m, n, dims, elem, hw) for m in modes}
            # the same schedules on the parts this run measured: hw rescaled so that each mode's compute-only
            # and comm-only times are the measured ones (see _rescaled); what remains is the overlap model
            parts = {id(m): _predict(op, m, n, dims, elem, _rescaled(hw, pred[id(m)], m[direction])) for m in modes}
            # the calibrated prediction at both ends of the contention figure's interval (None: no interval)
            ends = [{id(m): _predict(op, m, n, dims, elem, replace(hw, comm_cpu_s_per_byte=c)) for m in modes}
                    for c in bounds] if bounds else None
            spread = _spread(modes, direction)
            for m in modes:
                meas, p, q = m[direction], pred[id(m)], parts[id(m)]
                row = f"N={n} {shape.name} {_label(m)} {short}"
                ev = {"meas": meas, "pred": p, "spread": spread, "none": None, "comm_cpu": None,
                      "rounds": _round_interval(row, meas, None)}
                if ends:
                    ev["comm_cpu"] = (bounds, [_ovl_ideal(e[id(m)]) for e in ends])
                out.append(_row(row, "ovl/ideal", _ovl_ideal(p), meas["ovl_ideal"],
                                q.total / max(meas["compute"], meas["comm"]), ev))
                if none is not None and m is not none:
                    ev = {**ev, "none": (none[direction], pred[id(none)]),
                          "rounds": _round_interval(row, meas, none[direction])}
                    if ends:
                        ev["comm_cpu"] = (bounds, [e[id(m)].total / e[id(none)].total for e in ends])
                    out.append(_row(row, "vs none", p.total / pred[id(none)].total,
                                    meas["overlapped"] / none[direction]["overlapped"],
                                    q.total / parts[id(none)].total, ev))
    return out


def _ovl_ideal(t) -> float:
    return t.total / max(t.compute, t.comm)


NOTCH = 1.57
"""The median's interval, ``median +- 1.57 IQR / sqrt(n)`` (McGill, Tukey and Larsen's notch: about 95%
for two medians to differ when their notches do not overlap)."""


def _comm_cpu_bounds(figures: dict | None) -> tuple[float, float] | None:
    """(low, high) of the interval of the report's contention figure (``comm_cpu``: the median of the
    calibration's pairs and their quartiles, see :func:`flashpar.cost.calibrate.measure_comm_cpu`), at least
    0; None for a report without it (written before the figure existed)."""
    if not figures or not figures.get("pairs"):
        return None
    s_per_byte = max(0.0, float(figures["s_per_byte"]))
    half = NOTCH * (float(figures["q75"]) - float(figures["q25"])) / float(figures["pairs"]) ** 0.5
    return max(0.0, s_per_byte - half), s_per_byte + half


def _round_interval(row: str, meas: dict, none: dict | None) -> tuple[float, float, int] | None:
    """(low, high, rounds): the interval ``median +- 1.57 IQR / sqrt(rounds)`` (:data:`NOTCH`) of the row's
    ratio computed round by round from the slowest rank's times the report keeps (``samples``, see
    :mod:`flashpar.bench.overlap`): ``overlapped_i / max(compute_i, comm_i)`` for ``ovl/ideal`` (``none`` is
    None), ``overlapped_i / overlapped of none_i`` for ``vs none`` (the two ran in the same round, a few
    seconds apart).  None for a report without samples (older than them) or with fewer than 4 rounds."""
    samples = meas.get("samples")
    if not samples or (none is not None and not none.get("samples")):
        return None
    series = [samples["overlapped"], samples["compute"], samples["comm"]]
    if none is not None:
        series.append(none["samples"]["overlapped"])
    if len({len(v) for v in series}) > 1:
        raise ValueError(f"{row}: the report's per-round samples have different lengths "
                         f"{[len(v) for v in series]}; expected one value per round in each")
    if none is None:
        ratios = [o / max(c, m) for o, c, m in zip(*series[:3], strict=True)]
    else:
        ratios = [o / b for o, b in zip(series[0], series[3], strict=True)]
    if len(ratios) < 4:
        return None
    q25, _, q75 = statistics.quantiles(ratios, n=4)
    median, half = statistics.median(ratios), NOTCH * (q75 - q25) / len(ratios) ** 0.5
    return median - half, median + half, len(ratios)


def _predict(op: str, m: dict, n: int, dims, elem: int, hw: Hardware):
    """The simulated :class:`Timing` of schedule ``op`` (forward or backward) for the mode row ``m``."""
    from flashpar.overlap.schedule import build_schedule
    from flashpar.overlap.simulate import op_shapes, simulate

    mode, k, g = _run_mode(m)
    shape = op_shapes(op.removesuffix("_bwd"), n, *dims, elem)[op]
    extra = {"peers_per_piece": g} if g > 1 else {}
    return simulate(build_schedule(op, mode, n, 0, chunks=k, **extra), shape, hw)


def _rescaled(hw: Hardware, pred, meas: dict) -> Hardware:
    """``hw`` with every compute term scaled by measured / predicted compute-only time and every link term by
    measured / predicted comm-only time: the simulator then gives exactly the measured parts."""
    s_c = meas["compute"] / pred.compute if pred.compute > 0 else 1.0
    s_m = meas["comm"] / pred.comm if pred.comm > 0 else 1.0
    return replace(hw, flops=hw.flops / s_c, gemm_overhead_s=hw.gemm_overhead_s * s_c,
                   memory_bytes_per_s=hw.memory_bytes_per_s / s_c, link_bytes_per_s=hw.link_bytes_per_s / s_m,
                   link_latency_s=hw.link_latency_s * s_m)


def _spread(modes: list[dict], direction: str) -> tuple[str, float] | None:
    """The measurement's own spread in one shape and direction: (what was compared, |a / b - 1|), the largest of

    * ``auto``'s overlapped time against the row of the (mode, chunks) it picked: the same configuration,
      run twice in the same rounds;
    * the compute-only times of two rows that run the same GEMM pieces (flash and ring of one chunk count:
      the same rows per piece, as many pieces; or ``auto`` and its twin);
    * a row whose overlapped run was faster than its own compute-only run (by ``compute / overlapped - 1``),
      which no schedule can be.
    """
    found = []
    auto = next((m for m in modes if m["mode"] == "auto"), None)
    twin = next((m for m in modes if auto is not None and m["mode"] != "auto" and _run_mode(m) == _run_mode(auto)),
                None)
    if twin is not None:
        found.append((f"auto re-ran {_label(twin)}", abs(auto[direction]["overlapped"] / twin[direction]["overlapped"]
                                                         - 1.0)))
    for i, a in enumerate(modes):
        for b in modes[i + 1:]:
            (ma, ka, ga), (mb, kb, gb) = _run_mode(a), _run_mode(b)
            if ka == kb and ga == gb and (ma == mb or {ma, mb} == {"flash", "ring"}):
                gap = abs(a[direction]["compute"] / b[direction]["compute"] - 1.0)
                found.append((f"compute-only {_label(a)} vs {_label(b)}", gap))
    for m in modes:
        f = m[direction]
        if f["overlapped"] < f["compute"]:
            found.append((f"{_label(m)} overlapped below its compute-only run,", f["compute"] / f["overlapped"] - 1.0))
    return max(found, key=lambda f: f[1], default=None)


def _run_mode(m: dict) -> tuple[str, int, int]:
    """The (mode, chunks, peers per piece) the run executed for row ``m`` (``auto``: the pick it recorded, as
    ``flashpar.overlap.simulate.pick_label`` names it: ``mode(k=K)`` or ``mode(k=K,g=G)``)."""
    if m["mode"] == "auto":
        picked = m.get("picked", "none(k=1)")
        mode, _, rest = picked.partition("(k=")
        k, _, g = rest.rstrip(")").partition(",g=")
        return mode, int(k or 1), int(g or 1)
    return m["mode"], int(m["chunks"] or 1), 1


def _label(m: dict) -> str:
    if m["mode"] == "auto":
        return f"auto>{m.get('picked', '?')}"
    return f"{m['mode']}(k={m['chunks'] or 1})"


def _row(row: str, figure: str, predicted: float, measured: float, from_parts: float, ev: dict) -> dict:
    err = predicted / measured - 1.0 if measured else float("inf")
    why = _why(err, from_parts / measured - 1.0, {**ev, "measured": measured, "predicted": predicted,
                                                 "from_parts": from_parts}) if abs(err) > TOLERANCE else ""
    return {"row": row, "figure": figure, "predicted": predicted, "measured": measured, "from_parts": from_parts,
            "why": why}


def _why(err: float, parts_err: float, ev: dict) -> str:
    """The cause of a miss where the report's own figures show one, ``""`` otherwise:

    * the parts, not the overlap: the same schedules on this run's measured compute-only and comm-only
      times (``from_parts``) land within 15% of the measured ratio, while the calibration's parts are off
      (the factors are printed: the box's speed moved between the calibration and the rows);
    * the measurement's own spread (:func:`_spread`): two figures of this shape that should be equal differ
      by at least the miss (of the calibrated prediction or of the one on the measured parts);
    * the contention figure's own uncertainty: the calibrated prediction comes within 15% of the measured
      ratio for a ``comm_cpu_s_per_byte`` inside the interval of its median (:func:`_comm_cpu_bounds`);
    * the row's own rounds: the prediction (calibrated, else on the measured parts) is within 15% of a value
      inside the interval of the median of the row's per-round ratio (:func:`_round_interval`), i.e.
      ``0.85 low <= predicted <= 1.15 high``: this run cannot tell the measured ratio from one within 15% of
      the prediction.  A row whose rounds agree (a narrow interval) keeps its miss.
    """
    if abs(parts_err) <= TOLERANCE:
        meas, pred = ev["meas"], ev["pred"]
        factors = [f"compute-only x{meas['compute'] / pred.compute:.2f}, comm-only x{meas['comm'] / pred.comm:.2f}"]
        if ev["none"] is not None:
            nm, npred = ev["none"]
            factors.append(f"none's x{nm['compute'] / npred.compute:.2f}, x{nm['comm'] / npred.comm:.2f}")
        return f"parts off calibration ({'; '.join(factors)}); on the measured parts {parts_err:+.0%}"
    spread = ev["spread"]
    if spread is not None and spread[1] >= min(abs(err), abs(parts_err)):
        return f"noise: {spread[0]} {spread[1]:.0%} apart"
    if ev["comm_cpu"] is not None:
        (c_lo, c_hi), (r_lo, r_hi) = ev["comm_cpu"]
        lo, hi = min(r_lo, r_hi), max(r_lo, r_hi)
        measured = ev["measured"]
        if lo <= measured * (1 + TOLERANCE) and hi >= measured * (1 - TOLERANCE):
            return (f"contention figure's own interval: {c_lo * 1e9:.2f}-{c_hi * 1e9:.2f} ns/byte (median "
                    f"+-{NOTCH} IQR/sqrt(pairs)) predicts {lo:.2f}-{hi:.2f}")
    if ev["rounds"] is not None:
        lo, hi, k = ev["rounds"]
        for what, value in (("prediction", ev["predicted"]), ("prediction on the measured parts", ev["from_parts"])):
            if lo * (1 - TOLERANCE) <= value <= hi * (1 + TOLERANCE):
                return (f"noise: its {k} rounds put the ratio at {lo:.2f}-{hi:.2f} (median +-{NOTCH} "
                        f"IQR/sqrt(rounds)), within 15% of the {what} {value:.2f}")
    return ""
