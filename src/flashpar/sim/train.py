"""``flashpar simulate train``: one training step of a Llama on a (dp, cp, ulysses, tp) layout of a cluster.

For each configuration (``flashpar.sim.peers``: flashpar, baseline, torch, torch_async_tp) on the layout:
step time, tokens/s, MFU, exposed communication per parallelism (tp, ulysses, cp, dp) and memory per GPU,
from the runtime's schedules (``flashpar.overlap.simulate``), its plans (``flashpar.cp.plan``) and the one
cost model (``flashpar.cost``): ``flashpar.sim.predict`` (time: ``flashpar.sim.step``'s pieces on
``flashpar.sim.zero``'s data-parallel lanes), ``flashpar.sim.memory`` (bytes), ``flashpar.sim.topology``
(which link each group rides).  ``--search`` tries every layout of ``--gpus`` (``flashpar.sim.layouts``) and
prints the fastest that fit the GPU's memory; ``flashpar simulate table`` runs such searches over a grid.

    flashpar simulate train --model llama3-8b --gpus 64 --tp 8 --seq 8192
    flashpar simulate train --model llama3-70b --gpus 512 --seq 131072 --search --json out.json
    flashpar simulate train --model path/to/config.json --dp 2 --cp 4 --tp 8 --seq 32768

Every dp rank trains on ``--batch`` packed sequences of ``--seq`` tokens per step: the first pack of
``--lengths`` stands for each (``--packs K``: the first K, the slowest setting the step).  flashpar's ZeRO-3
gathers ``--prefetch`` units ahead; the ``zero`` column says how many blocks its auto schedule fuses and how
its units travel (``--zero-collective``: ring or doubling, ``flashpar.sim.zero``).  All figures are simulated.
"""

from __future__ import annotations

import argparse
import sys

from flashpar.sim.report import table, write_json

COLUMNS = [("config", ""), ("layout", ""), ("ckpt", ""), ("tp_mode", ""), ("zero", ""), ("step_ms", ".1f"),
           ("tokens_per_s", ",.0f"), ("mfu", ".1%"),
           ("exposed_ms", ".1f"), ("exposed_tp_ms", ".1f"), ("exposed_ulysses_ms", ".1f"), ("exposed_cp_ms", ".1f"),
           ("exposed_dp_ms", ".1f"), ("mem_gb", ".1f"), ("fits", "")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from flashpar.cp.lengths import LENGTHS_HELP
    from flashpar.sim.model_configs import SHIPPED
    from flashpar.sim.peers import NAMES

    p.add_argument("--model", default="llama3-8b",
                   help=f"a shipped model ({', '.join(SHIPPED)}) or a Hugging Face config.json (default llama3-8b)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in all (default: dp x cp x ulysses x tp)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: what fills --gpus, else 1)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (default 1)")
    p.add_argument("--ulysses", type=int, default=1, help="Ulysses size (default 1; needs --tp 1)")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel size (default 8)")
    p.add_argument("--seq", type=int, default=8192, help="tokens per packed sequence (default 8192)")
    p.add_argument("--batch", type=int, default=1, help="packed sequences per dp rank and step (default 1)")
    p.add_argument("--prefetch", type=int, default=1,
                   help="flashpar's ZeRO-3: units all-gathered ahead of the one computing (default 1)")
    p.add_argument("--zero-collective", default="auto", choices=("auto", "ring", "doubling"),
                   help="flashpar's ZeRO-3 units: the ring collectives, the doubling steps, or the cost model's "
                        "choice (default auto)")
    p.add_argument("--lengths", default="wlbllm", help=LENGTHS_HELP + " (default wlbllm)")
    p.add_argument("--packs", type=int, default=1, help="packs simulated, the slowest counts (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node, joined by NVLink (default 8)")
    p.add_argument("--hardware", default="h100-96gb",
                   help="the GPU and its link inside a node: a flashpar.cost preset (default h100-96gb: the H100 "
                        "whose efficiency figures are fitted to torchtitan's published runs, simulate anchors)")
    p.add_argument("--inter", default="h100-ib",
                   help="the preset whose link joins the nodes, one port per GPU (default h100-ib)")
    p.add_argument("--gpu-mem-gb", type=float, default=None,
                   help="memory per GPU (default: the preset's, 96 for h100-96gb)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="compute dtype (default bf16)")
    p.add_argument("--checkpoint-activations", choices=("auto", "on", "off"), default="auto",
                   help="recompute each block in backward: auto = only where the step does not fit without")
    p.add_argument("--configs", default=",".join(NAMES), help=f"subset of {','.join(NAMES)}")
    p.add_argument("--flashpar-mode", choices=tuple(FLASHPAR_MODES), default="best",
                   help="flashpar's tp / Ulysses mode: flash (the trainer's default), auto (--mode auto), or best: "
                        "the faster of the two per layout (default)")
    p.add_argument("--eager", action="store_true",
                   help="both sides without torch.compile: flashpar's eager kernels against torchtitan's (default: "
                        "both compiled, flashpar as `flashpar train --compile`)")
    p.add_argument("--search", action="store_true", help="try every layout of --gpus; print the fastest that fit")
    p.add_argument("--top", type=int, default=5, help="layouts printed per configuration with --search (default 5)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of a length distribution (default 0)")
    p.add_argument("--json", default=None, help="write {\"setup\": ..., \"rows\": [...]} to this file")


def _setup(args: argparse.Namespace):
    """(cfg, cluster, packs, layouts, capacity GB, configs), or ValueError (one line)."""
    from flashpar.cost import preset, preset_name
    from flashpar.cost.presets import STEP_SPREAD
    from flashpar.cp.lengths import resolve_lengths
    from flashpar.sim.layouts import candidates, problem
    from flashpar.sim.memory import GPU_MEMORY_GB
    from flashpar.sim.model_configs import load_model
    from flashpar.sim.peers import NAMES
    from flashpar.sim.topology import Cluster, Layout

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not configs or any(c not in NAMES for c in configs) or len(set(configs)) != len(configs):
        raise ValueError(f"--configs: expected distinct names from {','.join(NAMES)}, got {args.configs!r}")
    for name in ("seq", "batch", "prefetch", "packs", "gpus_per_node", "top"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    cfg = load_model(args.model)
    device, inter = preset(args.hardware), preset(args.inter)
    name = preset_name(args.hardware)
    capacity = args.gpu_mem_gb if args.gpu_mem_gb is not None else GPU_MEMORY_GB.get(name)
    if capacity is None:
        raise ValueError(f"--hardware {args.hardware} has no memory size on record: give --gpu-mem-gb")
    if not capacity > 0:
        raise ValueError(f"--gpu-mem-gb must be > 0, got {capacity}")
    cluster = Cluster(device, inter, args.gpus_per_node, name, preset_name(args.inter), STEP_SPREAD.get(name, 0.0))
    if args.search:
        if args.gpus is None:
            raise ValueError("--search needs --gpus")
        if args.gpus < 1:
            raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
        layouts = candidates(cfg, args.gpus, args.seq, args.gpus_per_node)
        if not layouts:
            raise ValueError(f"no layout of {args.gpus} GPUs runs {args.model} at --seq {args.seq}")
    else:
        inner = args.cp * args.ulysses * args.tp
        for key in ("cp", "ulysses", "tp"):
            if getattr(args, key) < 1:
                raise ValueError(f"--{key} must be >= 1, got {getattr(args, key)}")
        dp = args.dp if args.dp is not None else (args.gpus // inner if args.gpus and args.gpus % inner == 0 else 1)
        layout = Layout(dp, args.cp, args.ulysses, args.tp)
        gpus = args.gpus if args.gpus is not None else layout.gpus
        bad = problem(cfg, layout, gpus, args.seq, args.gpus_per_node)
        if bad:
            raise ValueError(bad)
        layouts = [layout]
    if layouts[0].gpus > args.gpus_per_node and layouts[0].gpus % args.gpus_per_node:
        raise ValueError(f"{layouts[0].gpus} GPUs do not fill whole nodes of --gpus-per-node {args.gpus_per_node}")
    try:
        source = resolve_lengths(args.lengths)
        packs = source.packs(args.seq, args.packs, seed=args.seed)
    except (OSError, ValueError) as err:
        raise ValueError(f"--lengths: {err}") from None
    if len(packs) < args.packs:
        raise ValueError(f"--lengths {args.lengths} fills {len(packs)} sequences of {args.seq} tokens, --packs "
                         f"asks for {args.packs}")
    return cfg, cluster, tuple(tuple(p) for p in packs), layouts, capacity, configs


FLASHPAR_MODES = {"flash": ("flash",), "auto": ("auto",), "best": ("flash", "auto")}
"""``--flashpar-mode``: the trainer's tp / Ulysses mode flashpar runs with, ``flash`` (its default) or ``auto``
(``--mode auto``: each op's picks of the cost model, ``flashpar.overlap.simulate.choose_modes``), or ``best``: the
faster of the two on each layout (as the torch configurations count DTensor's blocking TP and async TP)."""


def row(w, name: str, capacity: float, flashpar_mode: str = "best") -> dict:
    """One configuration on one workload, as a flat JSON row (flashpar: in ``flashpar_mode``)."""
    import dataclasses

    from flashpar.sim.memory import USABLE
    from flashpar.sim.peers import PEERS
    from flashpar.sim.predict import simulate
    from flashpar.sim.step import is_torch
    from flashpar.sim.zero import FUSED, zero_collective

    peer = PEERS[name]
    modes = FLASHPAR_MODES[flashpar_mode] if name == "flashpar" else (peer.mode,)
    runs = [(simulate(w, dataclasses.replace(peer, mode=m)), m) for m in modes]
    r, mode = min(runs, key=lambda x: x[0]["step_s"])
    L, mem = w.layout, r["memory"]
    links = {k: v[2] for k, v in w.groups(peer).items() if k in ("tp", "ulysses", "cp", "dp") and v[0] > 1}
    collective = zero_collective(w, dataclasses.replace(peer, mode=mode))
    zero = "fsdp" if is_torch(peer) else f"{r['schedule'].count(FUSED)}/{len(r['schedule'])} fused, {collective}"
    return {"config": name, "layout": L.label(), "dp": L.dp, "cp": L.cp, "ulysses": L.ulysses, "tp": L.tp,
            "gpus": L.gpus, "seq": w.seq, "batch": w.batch,
            "ckpt": "on" if w.checkpoint_activations else ("selective" if w.selective else "off"), "tp_mode": mode,
            "zero": zero, "zero_collective": collective,
            "schedule": list(r["schedule"]), "tail_ms": 1e3 * r["tail_s"],
            "step_ms": 1e3 * r["step_s"], "no_comm_ms": 1e3 * r["no_comm_s"],
            "exposed_ms": 1e3 * sum(r["exposed"].values()),
            **{f"exposed_{k}_ms": 1e3 * v for k, v in r["exposed"].items()},
            "tokens_per_s": r["tokens_per_s"], "tokens_per_s_per_gpu": r["tokens_per_s"] / L.gpus, "mfu": r["mfu"],
            "mem_gb": mem["total"], **{f"mem_{k}_gb": v for k, v in mem.items() if k != "total"},
            "fits": "yes" if mem["total"] <= USABLE * capacity else "no",
            "links": " ".join(f"{k}:{v}" for k, v in links.items())}


TITAN_RECOMPUTE = {"llama3-8b": "selective", "llama3-70b": "full"}
"""torchtitan's own activation checkpointing per model (``train_configs/llama3_8b.toml``: selective, per op;
``llama3_70b.toml``: full)."""


def simulate_rows(cfg, cluster, packs, layouts, capacity, configs, *, elem_bytes: int, checkpoint: str,
                  batch: int = 1, prefetch: int = 1, flashpar_mode: str = "best",
                  zero_collective: str = "auto", torch_recompute: str | None = None,
                  compiled: bool = True) -> list[dict]:
    """Every configuration on every layout: with ``checkpoint`` "auto", without activation checkpointing where
    that fits, else with it.  ``torch_recompute`` ("selective" or "full"): the torch configurations run that
    instead, fitting or not (torchtitan's defaults: ``TITAN_RECOMPUTE``).  ``compiled``: every side's blocks run
    their elementwise regions under torch.compile (flashpar's with ``--compile``), else every side eager."""
    from flashpar.sim.peers import PEERS
    from flashpar.sim.step import is_torch
    from flashpar.sim.workload import Workload

    rows = []
    for layout in layouts:
        for name in configs:
            modes = {"on": [True], "off": [False], "auto": [False, True]}[checkpoint]
            selective = False
            if torch_recompute is not None and is_torch(PEERS[name]):
                modes, selective = [torch_recompute == "full"], torch_recompute == "selective"
            for ckpt in modes:
                w = Workload(cfg, layout, cluster, packs, elem_bytes=elem_bytes, checkpoint_activations=ckpt,
                             batch=batch, prefetch=prefetch, zero_collective=zero_collective, selective=selective,
                             flashpar_compiled=compiled, torch_compiled=compiled)
                r = row(w, name, capacity, flashpar_mode)
                if r["fits"] == "yes" or ckpt == modes[-1]:
                    rows.append(r)
                    break
    return rows


def fastest(rows: list[dict], configs) -> dict:
    """Each configuration's fastest row that fits (None where none fits)."""
    return {name: max((r for r in rows if r["config"] == name and r["fits"] == "yes"),
                      key=lambda r: r["tokens_per_s"], default=None) for name in configs}


def run(args: argparse.Namespace) -> int:
    from flashpar.sim.elementwise import label as elementwise_label

    try:
        cfg, cluster, packs, layouts, capacity, configs = _setup(args)
    except ValueError as err:
        print(f"flashpar simulate train: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    rows = simulate_rows(cfg, cluster, packs, layouts, capacity, configs,
                         elem_bytes=2 if args.dtype == "bf16" else 4, checkpoint=args.checkpoint_activations,
                         batch=args.batch, prefetch=args.prefetch, flashpar_mode=args.flashpar_mode,
                         zero_collective=args.zero_collective, compiled=not args.eager)
    label = (f"simulated, {cluster.device_name}, {cluster.describe()}; {args.model} ({cfg.params / 1e9:.2f}B "
             f"params), {args.batch} x {args.seq} tokens per dp rank ({args.lengths}: {len(packs[0])} documents "
             f"per sequence), {args.dtype}, memory fits at {capacity:.0f} GB x 0.9\n"
             f"{elementwise_label(not args.eager)}")
    if args.search:
        print(f"{label}\nsearch: {len(layouts)} layouts of {args.gpus} GPUs")
        for name in configs:
            fit = sorted((r for r in rows if r["config"] == name and r["fits"] == "yes"),
                         key=lambda r: -r["tokens_per_s"])
            if not fit:
                print(f"\n{name}: no layout fits {capacity:.0f} GB")
                continue
            print()
            print(table(fit[: args.top], COLUMNS, title=f"{name}: the fastest {min(args.top, len(fit))} of "
                                                         f"{len(fit)} layouts that fit"))
        best = fastest(rows, configs)
        if best.get("flashpar"):
            f = best["flashpar"]
            others = ", ".join(f"{f['tokens_per_s'] / b['tokens_per_s']:.2f}x {n}'s best ({b['layout']})"
                               for n, b in best.items() if n != "flashpar" and b)
            print(f"\nfastest flashpar layout: {f['layout']} ({f['tokens_per_s']:,.0f} tokens/s, MFU {f['mfu']:.1%})"
                  + (f": {others}" if others else ""))
    else:
        print(table(rows, COLUMNS, title=label))
    setup = {"model": args.model, "params": cfg.params, "model_config": cfg.to_dict(), "gpus": layouts[0].gpus,
             "seq": args.seq, "batch": args.batch, "prefetch": args.prefetch, "flashpar_mode": args.flashpar_mode,
             "zero_collective": args.zero_collective,
             "lengths": args.lengths,
             "documents": [len(p) for p in packs],
             "hardware": cluster.device_name, "inter": cluster.inter_name, "gpus_per_node": cluster.gpus_per_node,
             "gpu_mem_gb": capacity, "dtype": args.dtype, "checkpoint_activations": args.checkpoint_activations,
             "search": bool(args.search), "compiled": not args.eager, "simulated": True}
    write_json(args.json, setup, rows)
    return 0
