"""``flashpar train``: the Llama-style model on real packed documents with TP-SP + CP + DP, in one command.

Without a launcher it checks the arguments, then spawns ``--nproc`` CPU processes on gloo (default
4: tp=2, cp=2).  Under ``torchrun`` (``RANK`` in the environment) every process is one rank of the
same job, with NCCL on GPUs when ``--device cuda``.  ``--check`` runs one step of the mesh model
against the single-process model instead of training and prints PASS / FAIL per parameter group.

Bad arguments (a mesh whose product is not the world size, heads / kv heads / FFN / vocabulary not
divisible by tp, a sequence too short for the cp size, an unwritable output folder, no documents,
a checkpoint made with other model or data settings) stop with one line before any process group
starts.  A rank that fails makes the launcher stop the others; every
wait has the ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from flashpar.cp import STRATEGIES
from flashpar.models import LlamaConfig

MODES = ("flash", "ring", "slice", "none", "auto")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=4, help="processes to spawn without torchrun (default 4)")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per packed sequence (default 2048)")
    p.add_argument("--strategy", default="flashcp", choices=STRATEGIES, help="context-parallel plan (default flashcp)")
    p.add_argument("--mode", default="flash", choices=MODES, help="TP overlap mode (default flash)")
    p.add_argument("--dp-mode", default="zero3", choices=["zero3", "replicate"],
                   help="data parallelism: ZeRO-3 rows of the tp weights per dp rank, or whole copies (default zero3)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-docs", type=int, default=None, help="use only this many corpus documents")
    p.add_argument("--hidden", type=int, default=LlamaConfig.hidden)
    p.add_argument("--layers", type=int, default=LlamaConfig.layers)
    p.add_argument("--heads", type=int, default=LlamaConfig.heads)
    p.add_argument("--kv-heads", type=int, default=LlamaConfig.kv_heads)
    p.add_argument("--ffn", type=int, default=LlamaConfig.ffn)
    p.add_argument("--hf-config", default=None, help="a Hugging Face Llama config.json (overrides the sizes)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    p.add_argument("--workers", type=int, default=1, help="data-loader workers per rank (they run the planner)")
    p.add_argument("--out", default="runs/train", help="folder for metrics.jsonl and summary.json")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any distributed wait may take")
    p.add_argument("--check", action="store_true", help="compare one step against the single-process model")
    p.add_argument("--trace", action="store_true", help="write a Chrome/Perfetto trace of the third step, per rank")
    p.add_argument("--plot", action="store_true", help="write train.png: loss curve and per-rank work of the plans")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every K steps and at the end (0: never)")
    p.add_argument("--resume", default=None,
                   help="continue from a checkpoint folder (or a run's checkpoints/ folder: its newest); "
                        "the mesh may differ")


def config_from(args: argparse.Namespace) -> dict:
    """The job's settings, validated (raises ``ValueError`` with one line)."""
    if args.hf_config:
        model = LlamaConfig.from_hf(args.hf_config)
    else:
        model = LlamaConfig(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                            ffn=args.ffn)
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    mesh = (args.dp, args.cp, args.tp)
    if min(mesh) < 1 or args.dp * args.cp * args.tp != world:
        raise ValueError(f"mesh dp x cp x tp = {args.dp} x {args.cp} x {args.tp} = {args.dp * args.cp * args.tp} "
                         f"does not match the {world} processes")
    for name, size in (("heads", model.heads), ("kv heads", model.kv_heads), ("FFN size", model.ffn),
                       ("vocabulary size", model.vocab_size)):
        if size % args.tp:
            raise ValueError(f"{name} = {size} is not divisible by tp = {args.tp}")
    if args.seq_len < 2 * args.cp * args.tp:
        raise ValueError(f"seq-len {args.seq_len} is too short for cp = {args.cp} x tp = {args.tp} "
                         f"(at least {2 * args.cp * args.tp} tokens)")
    if args.steps < 1:
        raise ValueError(f"steps must be at least 1, got {args.steps}")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"output folder {out} is not writable: {err.strerror or err}") from err
    from flashpar.corpus import document_lengths

    try:
        tokens = sum(document_lengths(args.max_docs))
    except FileNotFoundError as err:
        raise ValueError(f"no training documents: {err}") from err
    if tokens < args.seq_len * args.dp:
        raise ValueError(f"the corpus has {tokens} tokens, fewer than one global batch ({args.dp} x {args.seq_len})")
    resume = None
    if args.resume:
        from flashpar.train.checkpoint import latest

        resume = str(latest(Path(args.resume)))  # FileNotFoundError: one line below
    if args.plot:
        from flashpar.train.report import have_matplotlib

        if not have_matplotlib():
            raise ValueError("--plot needs matplotlib (pip install 'flashpar[plot]')")
    if args.save_every < 0:
        raise ValueError(f"save-every must be >= 0, got {args.save_every}")
    return {"resume": resume, "save_every": args.save_every, "trace": args.trace, "plot": args.plot,
            "model": model.to_dict(),
            "dp": args.dp, "cp": args.cp, "tp": args.tp, "dp_mode": args.dp_mode, "steps": args.steps,
            "seq_len": args.seq_len, "strategy": args.strategy, "mode": args.mode, "lr": args.lr, "seed": args.seed,
            "max_docs": args.max_docs, "device": args.device, "threads": args.threads, "workers": args.workers,
            "out": str(out), "timeout": args.timeout, "check": args.check}


def rank_main(config: dict) -> dict | None:
    """One rank: train, or check (returns rank 0's summary or check rows)."""
    if config["check"]:
        return _check(config)
    from flashpar.train.loop import train

    return train(config)


def _check(config: dict):
    import torch
    import torch.distributed as dist

    from flashpar.train.check import by_group, one_step
    from flashpar.train.data import PackedCorpus
    from flashpar.train.loop import setup

    _, mesh = setup(config)
    cfg = LlamaConfig(**config["model"])
    data = PackedCorpus(config["seq_len"], max_docs=config["max_docs"], seed=config["seed"])
    seqs = [(data[i]["tokens"], data[i]["labels"], data[i]["doc_lens"]) for i in range(config["dp"])]
    errors = one_step(cfg, mesh, seqs, strategy=config["strategy"], mode=config["mode"], seed=config["seed"],
                      timeout_s=config["timeout"], dp_mode=config["dp_mode"])
    rows = by_group(errors)
    worst = torch.tensor([max(e for _, e, _ in rows)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"rows": rows, "worst": float(worst)} if dist.get_rank() == 0 else None


def _spawned(rank: int, world: int, port: int, config: dict, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch.distributed as dist

    try:
        out = rank_main(config)
        if rank == 0:
            Path(result_path).write_text(json.dumps(out))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from(args)
        if config["resume"]:
            from flashpar.train.checkpoint import read_meta

            read_meta(Path(config["resume"]), config)  # same model, data and seed, or one line here
    except (ValueError, FileNotFoundError) as err:
        print(f"flashpar train: {err}", file=sys.stderr)
        return 2
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        out = rank_main(config)
        _report(out, config)
        return 0
    import torch.multiprocessing as mp

    from flashpar.bench.netlink import free_port

    result = Path(config["out"]) / (".check.json" if config["check"] else ".result.json")  # rank 0's return
    result.unlink(missing_ok=True)
    try:
        mp.start_processes(_spawned, args=(args.nproc, free_port(), config, str(result)), nprocs=args.nproc,
                           join=True, start_method="spawn")
    except mp.ProcessRaisedException as err:  # the rank's exception: its traceback, then one line
        text = str(err).strip()
        print(text, file=sys.stderr)
        print(f"flashpar train: a rank failed: {text.splitlines()[-1]}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as err:  # died without a Python exception (killed, os._exit, crash)
        print(f"flashpar train: a rank failed: {err}", file=sys.stderr)
        return 1
    out = json.loads(result.read_text())
    return _report(out, config)


def _report(out, config: dict) -> int:
    if out is None:
        return 0
    if config["check"]:
        print(f"check: mesh dp={config['dp']} ({config['dp_mode']}) cp={config['cp']} tp={config['tp']}, "
              f"strategy {config['strategy']}, "
              f"mode {config['mode']}, one step against the single-process model (relative error, fp32 bound 1e-4)")
        for name, err, ok in out["rows"]:
            print(f"  {'PASS' if ok else 'FAIL'}  {name:<16} {err:.2e}")
        passed = all(ok for _, _, ok in out["rows"])
        print("PASS" if passed else "FAIL")
        return 0 if passed else 1
    s = out
    if s["steps"] == 0:
        print(f"nothing to train: the run is already at --steps {config['steps']}")
        return 0
    print(f"\ntrained {s['steps']} steps on mesh dp={s['mesh']['dp']} cp={s['mesh']['cp']} tp={s['mesh']['tp']} "
          f"in {s['wall_s']:.0f} s: loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}, "
          f"{s['tokens_per_s']:.0f} tokens/s, MFU {s['mfu']:.1%} (of a GEMM-probe peak)")
    print(f"{s['strategy']} plans: forward K/V {s['kv_bytes'] / 1e6:.1f} MB sent (plans: "
          f"{s['plan_kv_bytes'] / 1e6:.1f} MB) vs {s['per_doc_kv_bytes'] / 1e6:.1f} MB for per_doc and "
          f"{s['headtail_kv_bytes'] / 1e6:.1f} MB for headtail; estimated step (cost model) "
          f"{s['per_doc_est_step_ms'] / max(s['est_step_ms'], 1e-12):.2f}x faster than per_doc, "
          f"{s['headtail_est_step_ms'] / max(s['est_step_ms'], 1e-12):.2f}x than headtail")
    extra = [f"plot: {s['plot']}"] if s.get("plot") else []
    extra += [f"traces: {Path(s['out']) / 'trace_rank*.json'}"] if config.get("trace") else []
    extra += [f"checkpoints: {Path(s['out']) / 'checkpoints'}"] if config.get("save_every") else []
    print("; ".join([f"metrics: {Path(s['out']) / 'metrics.jsonl'}", f"summary: {Path(s['out']) / 'summary.json'}",
                     *extra]))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="flashpar train")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
