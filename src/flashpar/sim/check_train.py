"""``flashpar simulate check`` on a ``flashpar bench train`` report: every configuration's step predicted from
the calibration in the file, the tokens/s ratios compared.

The bench's own run, rebuilt from ``report["setup"]``: its model (untied, the byte vocabulary), its mesh, its
packed documents (``flashpar.sim.bench_runs.packed_docs``: the same lengths, scale and seed), fp32, on a one-node
"cluster" whose every group rides the one emulated link of the calibration (``setup.hardware``: GEMM rate,
the executor's overheads, link bandwidth and latency, memory; ``attn_fwd`` / ``attn_bwd``: the CPU flash
kernel's curves).  What the bench runs that a GPU cluster would not, the simulator is told:

* the torch peers' attention: ``torch`` and ``torch_compile`` call SDPA per (document, chunk) against the
  document's earlier keys (``torch_attention="docs"``: each call's masked rectangle, ``flashpar.sim.step.
  chunk_calls``), ``torch_dense`` one SDPA with a document mask over all ``S_loc x S`` scores
  (``torch_attention="dense"``); torch's CPU flash kernel runs both, which the calibration's attention
  curve times.  ``torch_compile`` is simulated as ``torch`` with its elementwise work fused (the comm-model rows
  take its measured no-communication step);
* each side's elementwise work as the bench ran it (``flashpar.sim.elementwise``): ``torch`` and ``torch_dense``
  eager, ``torch_compile`` and ``flashpar_compile`` (the trainer with ``--compile``, simulated as flashpar)
  compiled, flashpar and baseline compiled only where the report's setup says so (``setup.compile``; a report
  without it ran them eager);
* the torch peers' FSDP2 gathers a block when the block's forward starts
  (``fsdp_prefetch=False``: an assumption, on CPU no stream lets the host run ahead and issue it earlier)
  and gathers every block again for backward, the last one too (``fsdp_keep_last=False``:
  ``flashpar.bench.torch_parallel`` reshards every block after forward);
* gradient reduce-scatters are fp32 like everything else (the bench runs fp32).

Compared (each predicted against measured, ``flashpar.sim.check.finish`` marks what is within 15%), two ways:

    full    the whole step from the calibration:      tokens/s flashpar / baseline, flashpar / torch
    comm    the measured no-communication step plus   the same two ratios, and each configuration's
            the predicted exposed communication       step / no-comm step (how much it hides)

"full" is what the simulator does at cluster scale; "comm" isolates the communication model (what the
schedules hide, on the link the file calibrated) from the compute model, which on this box misses the CPU's
host overhead and the ranks' sharing of too few cores (the no-comm step measures both).

A miss gets a reason only from the file's own figures: which part of the prediction (the no-communication
step or the exposed communication, of which configuration) is off, by how much.
"""

from __future__ import annotations

from flashpar.sim.peers import NAMES, PEERS

TORCH_ATTENTION = {"torch": "docs", "torch_compile": "docs", "torch_dense": "dense"}  # bench train's torch peers
BENCH_NAMES = (*NAMES, "flashpar_compile", "torch_compile", "torch_dense")
COMPILED_FLASHPAR = "flashpar_compile"  # the trainer with --compile: flashpar with its elementwise regions fused


def peer_of(name: str):
    """The simulator's configuration of the bench's ``name`` (the torch peers all run as ``torch``, flashpar_compile as
    ``flashpar``)."""
    return PEERS["torch" if name in TORCH_ATTENTION else "flashpar" if name == COMPILED_FLASHPAR else name]


def workload(report: dict, name: str):
    """The bench's run of configuration ``name`` as a :class:`flashpar.sim.workload.Workload`."""
    from flashpar.cost import Hardware
    from flashpar.sim.bench_runs import model_config, packed_docs
    from flashpar.sim.topology import Cluster, Layout
    from flashpar.sim.workload import Workload

    s = report["setup"]
    if "hardware" not in s:
        raise ValueError("the report has no calibration (setup.hardware): run `flashpar bench train` again "
                         "(its reports carry the calibration)")
    cfg = model_config(s)
    hw = Hardware(**{**s["hardware"], **s["attn_fwd"]})
    bwd = (s["attn_bwd"]["attn_peak"], s["attn_bwd"]["attn_half"])
    layout = Layout(s["dp"], s["cp"], s["ulysses"], s["tp"])
    cluster = Cluster(hw, hw, gpus_per_node=layout.gpus, device_name="calibrated", inter_name="calibrated")
    packs = tuple(tuple(p) for p in packed_docs(s))
    regather = s.get("regather", True)  # a report without it: its trainer gathered again
    if not isinstance(regather, bool):
        raise ValueError(f"the report's setup.regather must be true or false, got {regather!r}")
    gather_vocab = s.get("gather_vocab", False)  # a report without it: activations moved
    if not isinstance(gather_vocab, bool):
        raise ValueError(f"the report's setup.gather_vocab must be true or false, got {gather_vocab!r}")
    flashpar_compiled = s.get("compile", False)  # a report without it: flashpar's blocks ran eager
    if not isinstance(flashpar_compiled, bool):
        raise ValueError(f"the report's setup.compile must be true or false, got {flashpar_compiled!r}")
    plan_hw, per_step = plan_hardware(s)
    burst = plan_burst(s)
    group = s["tp"] if name in TORCH_ATTENTION else s["tp"] * s["ulysses"]  # a cp rank's processes (torch: no Ulysses)
    return Workload(cfg, layout, cluster, packs, elem_bytes=4, attn_bwd=bwd, zero_rs_elem_bytes=4,
                    torch_attention=TORCH_ATTENTION.get(name, "flex"), fsdp_prefetch=False, fsdp_keep_last=False,
                    regather=regather, gather_vocab=gather_vocab,
                    flashpar_compiled=flashpar_compiled or name == COMPILED_FLASHPAR,
                    torch_compiled=name == "torch_compile",
                    plan_hardware=plan_hw, plan_per_step=per_step, plan_burst=burst,
                    shared_cores=run_burst(s, group))


def plan_hardware(setup: dict):
    """(Hardware, per step) the report's trainer planned with: ``setup.plan_hardware``
    (``flashpar.train.planning.planner_cost``), else the h100-ib preset, forward only (a report without it)."""
    import dataclasses

    from flashpar.cost import preset

    figures = setup.get("plan_hardware")
    if figures is None:
        return preset("h100-ib"), False
    if not isinstance(figures, dict):
        raise ValueError(f"the report's setup.plan_hardware must be an object of Hardware figures, got "
                         f"{type(figures).__name__}")
    try:
        return dataclasses.replace(preset("cpu"), **figures), True
    except (TypeError, ValueError) as e:
        raise ValueError(f"the report's setup.plan_hardware: {e}") from None


def plan_burst(setup: dict) -> float:
    """``CostModel.burst`` the report's trainer planned with: ``setup.plan_burst``
    (``flashpar.links.core_burst``), else 1 (a report without it: planned as if each rank had its own
    device)."""
    from flashpar import cp

    burst = setup.get("plan_burst", 1.0)
    try:
        return cp.CostModel(burst=burst).burst
    except ValueError as e:
        raise ValueError(f"the report's setup.plan_burst: {e}") from None


def run_burst(setup: dict, group: int) -> float:
    """``CostModel.burst`` of the run itself, its cp ranks of ``group`` processes sharing the box's cores
    (``flashpar.cost.shared_burst`` of ``world_size`` processes of ``threads`` threads on ``cores``: every rank
    of ``flashpar bench train`` runs on the one host); 1 for a report that does not say its cores."""
    from flashpar.cost import shared_burst

    if setup.get("cores") is None:
        return 1.0
    try:
        return shared_burst(setup["world_size"], setup["threads"], setup["cores"], group)
    except (KeyError, ValueError) as e:
        raise ValueError(f"the report's setup (world_size, threads, cores): {e}") from None


def predict(report: dict) -> dict[str, dict]:
    """``flashpar.sim.predict.simulate`` of every configuration the report measured."""
    from flashpar.sim.predict import simulate

    names = [r["name"] for r in report["configs"]]
    unknown = [n for n in names if n not in BENCH_NAMES]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown} in the report (expected {', '.join(BENCH_NAMES)})")
    return {n: simulate(workload(report, n), peer_of(n)) for n in names}


def _why(pred: dict, meas: dict, names: list[str], comm_only: bool = False) -> str:
    """Which part of which configuration's step the prediction misses most (from the file's figures); with
    ``comm_only`` (the comm-model rows, which take the measured no-comm step) only the exposed communication."""
    parts = []
    for n in names:
        p, m = pred[n], meas[n]
        figures = [("no-comm step", 1e3 * p["no_comm_s"], m["no_comm_ms"])] if not comm_only else []
        figures.append(("exposed", 1e3 * (p["step_s"] - p["no_comm_s"]), m["exposed_ms"]))
        for label, pv, mv in figures:
            parts.append((abs(pv - mv) / max(m["step_ms"], 1e-9), f"{n} {label} {pv:.0f} ms predicted, {mv:.0f} "
                                                                   f"measured"))
    parts.sort(reverse=True)
    return "; ".join(text for _, text in parts[:2])


def check(report: dict) -> list[dict]:
    meas = {r["name"]: r for r in report["configs"]}
    pred = predict(report)
    # "comm": each configuration's measured no-communication step plus its predicted exposed communication
    comm = {n: m["no_comm_ms"] / 1e3 + pred[n]["step_s"] - pred[n]["no_comm_s"] for n, m in meas.items()}
    rows = []
    pairs = [("flashpar", other) for other in ("baseline", *TORCH_ATTENTION)]
    pairs += [(COMPILED_FLASHPAR, "torch_compile"), (COMPILED_FLASHPAR, "flashpar")]  # compiled vs compiled; --compile
    for steps, label, comm_only in (({n: p["step_s"] for n, p in pred.items()}, "tokens/s ratio", False),
                                    (comm, "tokens/s ratio, comm model", True)):
        for ours, other in ((a, b) for a, b in pairs if a in meas and b in meas):
            p = steps[other] / steps[ours]
            m = meas[ours]["tokens_per_s"] / meas[other]["tokens_per_s"]
            rows.append({"row": f"{ours} vs {other}", "figure": label, "predicted": p, "measured": m,
                         "why": "" if abs(p / m - 1) <= 0.15 else _why(pred, meas, [ours, other], comm_only)})
    for n, m in meas.items():
        p = comm[n] / (m["no_comm_ms"] / 1e3)
        mv = m["step_ms"] / m["no_comm_ms"]
        rows.append({"row": n, "figure": "step / no-comm, comm model", "predicted": p, "measured": mv,
                     "why": "" if abs(p / mv - 1) <= 0.15 else _why(pred, meas, [n], True)})
    return rows
