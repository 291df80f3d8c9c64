"""``flashpar simulate table``: ``simulate train --search`` over a grid of (model, GPUs, sequence length), one
markdown row per cell: each configuration's fastest layout that fits, and how many layouts fit.

    flashpar simulate table --hardware h100-96gb           # llama3-8b, llama3-70b x 64, 512 GPUs x 8K .. 128K
    flashpar simulate table --models llama3-8b --gpus 64 --seqs 8K --json cell.json
    flashpar simulate table --eager                         # both sides without torch.compile

Per cell and configuration: the fastest layout (with flashpar's tp mode, "ckpt" where it needs activation
checkpointing, and flashpar's fused block count), tokens/s per GPU, MFU, the exposed share of its step, memory
per GPU; then flashpar's tokens/s over the faster torch configuration's, the share that one exposes, and the
layouts that fit per configuration (``flashpar.sim.train.simulate_rows`` with checkpointing auto).  Every
figure is simulated on the ``--hardware`` preset, which the title names.  Both sides run their blocks'
elementwise regions compiled (torch.compile; flashpar's figures are those of ``flashpar train --compile``), or
both eager with ``--eager`` (``flashpar.sim.elementwise``); a line under the title says which.
"""

from __future__ import annotations

import argparse
import sys
import time

from flashpar.sim.report import write_json

DEFAULT_CONFIGS = "flashpar,torch,torch_async_tp"
TITAN_NOTE = "; the torch configurations with torchtitan's own: sac (selective, per op) for 8B, full for 70B"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="llama3-8b,llama3-70b", help="models, comma-separated (default both shipped)")
    p.add_argument("--gpus", default="64,512", help="GPU counts, comma-separated (default 64,512)")
    p.add_argument("--seqs", default="8K,32K,128K", help="sequence lengths, comma-separated, K/M suffixes "
                                                         "(default 8K,32K,128K)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"configurations (default {DEFAULT_CONFIGS})")
    p.add_argument("--hardware", default="h100-96gb", help="the GPU preset (default h100-96gb)")
    p.add_argument("--inter", default="h100-ib", help="the link between nodes (default h100-ib)")
    p.add_argument("--lengths", default="wlbllm", help="document lengths, as simulate train's (default wlbllm)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--flashpar-mode", choices=("flash", "auto", "best"), default="best",
                   help="flashpar's tp / Ulysses mode, as simulate train's (default best)")
    p.add_argument("--torch-recompute", choices=("auto", "titan"), default="auto",
                   help="the torch configurations' activation checkpointing: auto (none where the step fits, else "
                        "full, as flashpar's) or titan (torchtitan's defaults: selective for llama3-8b, full for "
                        "llama3-70b)")
    p.add_argument("--eager", action="store_true",
                   help="both sides without torch.compile: flashpar's eager kernels against torchtitan's (default: "
                        "both compiled, flashpar as `flashpar train --compile`)")
    p.add_argument("--json", default=None, help="write {\"setup\": ..., \"rows\": [...]} to this file")


def _grid(args) -> tuple[list[str], list[int], list[int], list[str]]:
    from flashpar.sim.cp import parse_counts, parse_list, parse_size
    from flashpar.sim.peers import NAMES

    gpus = parse_counts(args.gpus, "--gpus")
    try:
        seqs = [parse_size(x) for x in parse_list(args.seqs, "--seqs")]
    except ValueError as err:
        raise ValueError(f"--seqs: {err}") from None
    configs = parse_list(args.configs, "--configs")
    if "flashpar" not in configs or any(c not in NAMES for c in configs) or len(set(configs)) != len(configs):
        raise ValueError(f"--configs: expected distinct names from {','.join(NAMES)} with flashpar, got "
                         f"{args.configs!r}")
    if args.gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
    return parse_list(args.models, "--models"), gpus, seqs, configs


def cell(model: str, gpus: int, seq: int, configs: list[str], hardware: str, inter: str, lengths: str,
         gpus_per_node: int = 8, flashpar_mode: str = "best", torch_recompute: str = "auto",
         compiled: bool = True) -> dict:
    """One (model, GPUs, seq) search: per configuration the fastest fitting row and the count that fit
    (``torch_recompute`` "titan": the torch configurations with torchtitan's checkpointing for the model;
    ``compiled``: every side's elementwise regions under torch.compile, else every side eager)."""
    from flashpar.cost import preset, preset_name
    from flashpar.cost.presets import STEP_SPREAD
    from flashpar.cp.lengths import resolve_lengths
    from flashpar.sim.layouts import candidates
    from flashpar.sim.memory import GPU_MEMORY_GB
    from flashpar.sim.model_configs import load_model
    from flashpar.sim.topology import Cluster
    from flashpar.sim.train import TITAN_RECOMPUTE, fastest, simulate_rows

    cfg = load_model(model)
    name = preset_name(hardware)
    capacity = GPU_MEMORY_GB.get(name)
    if capacity is None:
        raise ValueError(f"--hardware {hardware} has no memory size on record")
    cluster = Cluster(preset(hardware), preset(inter), gpus_per_node, name, preset_name(inter),
                      STEP_SPREAD.get(name, 0.0))
    layouts = candidates(cfg, gpus, seq, gpus_per_node)
    if not layouts:
        raise ValueError(f"no layout of {gpus} GPUs runs {model} at seq {seq}")
    packs = tuple(tuple(p) for p in resolve_lengths(lengths).packs(seq, 1))
    titan = TITAN_RECOMPUTE.get(model) if torch_recompute == "titan" else None
    if torch_recompute == "titan" and titan is None:
        raise ValueError(f"--torch-recompute titan: torchtitan's default for {model} is not on record "
                         f"(known: {', '.join(TITAN_RECOMPUTE)})")
    rows = simulate_rows(cfg, cluster, packs, layouts, capacity, configs, elem_bytes=2, checkpoint="auto",
                         flashpar_mode=flashpar_mode, torch_recompute=titan, compiled=compiled)
    best = fastest(rows, configs)
    fits = {c: sum(r["config"] == c and r["fits"] == "yes" for r in rows) for c in configs}
    return {"model": model, "gpus": gpus, "seq": seq, "layouts": len(layouts), "best": best, "fits": fits}


def _cfg_cells(r: dict | None) -> list[str]:
    if r is None:
        return ["none fits", "-", "-", "-", "-"]
    extra = [r["tp_mode"] if r["config"] == "flashpar" and r["tp"] * r["ulysses"] > 1 else "",
             {"on": "ckpt", "selective": "sac"}.get(r["ckpt"], ""),
             r["zero"] if r["zero"].split("/")[0] not in ("fsdp", "0") else ""]
    dims = [f"{k}{r[k]}" for k in ("dp", "cp", "ulysses", "tp") if r[k] > 1 or k == "dp"]
    layout = " ".join(dims).replace("ulysses", "u") + (f" ({', '.join(x for x in extra if x)})" if any(extra) else "")
    return [layout, f"{r['tokens_per_s_per_gpu']:,.0f}", f"{r['mfu']:.1%}", f"{r['exposed_ms'] / r['step_ms']:.0%}",
            f"{r['mem_gb']:.0f}"]


def markdown(cells: list[dict], configs: list[str]) -> str:
    head = ["model", "GPUs", "seq"]
    for c in configs:
        head += [f"{c}: layout", "tok/s/GPU", "MFU", "exposed", "mem GB"]
    torches = [c for c in configs if c.startswith("torch")]
    head += ["flashpar x best torch", "torch exposed", "fits " + " / ".join(configs)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cl in cells:
        row = [cl["model"], str(cl["gpus"]), f"{cl['seq'] // 1024}K"]
        for c in configs:
            row += _cfg_cells(cl["best"][c])
        f = cl["best"]["flashpar"]
        ts = [cl["best"][c] for c in torches if cl["best"][c]]
        top = max(ts, key=lambda r: r["tokens_per_s"], default=None)
        row.append(f"{f['tokens_per_s'] / top['tokens_per_s']:.2f}" if f and top else "-")
        row.append(f"{top['exposed_ms'] / top['step_ms']:.0%}" if top else "-")
        row.append(" / ".join(str(cl["fits"][c]) for c in configs) + f" of {cl['layouts']}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from flashpar.sim.elementwise import label

    try:
        models, gpus, seqs, configs = _grid(args)
        cells = []
        t0 = time.perf_counter()
        for model in models:
            for g in gpus:
                for seq in seqs:
                    t = time.perf_counter()
                    cells.append(cell(model, g, seq, configs, args.hardware, args.inter, args.lengths,
                                      args.gpus_per_node, args.flashpar_mode, args.torch_recompute,
                                      not args.eager))
                    cells[-1]["search_s"] = time.perf_counter() - t
    except (OSError, ValueError) as err:
        print(f"flashpar simulate table: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"simulated, {args.hardware} preset ({args.gpus_per_node} GPUs per node, {args.inter} between nodes), bf16, "
          f"{args.lengths} documents, one packed sequence per dp rank; each configuration's fastest layout that fits "
          f"(checkpointing where needed{TITAN_NOTE if args.torch_recompute == 'titan' else ''}; "
          f"flashpar's tp mode: {args.flashpar_mode})")
    print(label(not args.eager))
    print(markdown(cells, configs))
    print(f"{len(cells)} searches in {time.perf_counter() - t0:.0f} s")
    setup = {"hardware": args.hardware, "inter": args.inter, "lengths": args.lengths, "configs": configs,
             "flashpar_mode": args.flashpar_mode, "torch_recompute": args.torch_recompute,
             "gpus_per_node": args.gpus_per_node, "compiled": not args.eager, "simulated": True}
    rows = [{**{k: v for k, v in c.items() if k != "best"}, **{f"{n}_best": c["best"][n] for n in configs}}
            for c in cells]
    write_json(args.json, setup, rows)
    return 0
