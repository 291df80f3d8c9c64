"""``flashpar`` command line: ``flashpar train ...``, ``flashpar export ...``, ``flashpar bench
overlap|cp|plan|train ...``, ``flashpar plan ...``, ``flashpar simulate overlap|cp|train|check ...``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from flashpar.bench import cp as bench_cp
    from flashpar.bench import overlap as bench_overlap
    from flashpar.bench import plan_targets
    from flashpar.bench import prefill as bench_prefill
    from flashpar.bench import train as bench_train
    from flashpar.cp import cli as plan_cli
    from flashpar.infer import cli as generate_cli
    from flashpar.sim import cli as sim_cli
    from flashpar.train import export as train_export
    from flashpar.train import run as train_run

    parser = argparse.ArgumentParser(prog="flashpar",
                                     description="flashpar: overlapped parallelism and context-parallel planning")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks that compare alternatives side by side")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    ov = bench_sub.add_parser("overlap", help="all overlap modes of all_gather_matmul / matmul_reduce_scatter")
    bench_overlap.add_arguments(ov)
    bc = bench_sub.add_parser("cp", help="every context-parallel strategy side by side, forward and backward")
    bench_cp.add_arguments(bc)
    bt = bench_sub.add_parser("train", help="the trainer (flashpar, baseline) and torch's own stack side by side")
    bench_train.add_arguments(bt)
    bp = bench_sub.add_parser("plan", help="the FlashCP planner against its targets on real document lengths")
    plan_targets.add_arguments(bp)
    bench_prefill.add_arguments(bench_sub.add_parser("prefill", help="inference: flashpar, baseline and torch prefill"))
    tr = sub.add_parser("train", help="train the Llama-style model with TP-SP + CP + DP on real packed documents")
    train_run.add_arguments(tr)
    ex = sub.add_parser("export", help="a training checkpoint as a Hugging Face Llama folder")
    train_export.add_arguments(ex)
    pl = sub.add_parser("plan", help="plan context parallelism for packed documents, every strategy side by side")
    plan_cli.add_arguments(pl)
    sim = sub.add_parser("simulate", help="cluster-scale predictions from the runtime's own schedules and plans")
    sim_cli.add_arguments(sim)
    generate_cli.add_arguments(sub.add_parser("generate", help="prefill and decode prompts over a (tp, cp) mesh"))
    args = parser.parse_args(argv)
    if args.command == "generate":
        return generate_cli.run(args)
    if args.command == "bench" and args.bench == "prefill":
        return bench_prefill.run(args)
    if args.command == "plan":
        return plan_cli.run(args)
    if args.command == "simulate":
        return sim_cli.run(args)
    if args.command == "train":
        return train_run.run(args)
    if args.command == "export":
        return train_export.run(args)
    if args.command == "bench" and args.bench == "overlap":
        return bench_overlap.run(args)
    if args.command == "bench" and args.bench == "cp":
        return bench_cp.run(args)
    if args.command == "bench" and args.bench == "train":
        return bench_train.run(args)
    if args.command == "bench" and args.bench == "plan":
        return plan_targets.run(args)
    parser.error("unknown command")
    return 2


if __name__ == "__main__":
    sys.exit(main())
