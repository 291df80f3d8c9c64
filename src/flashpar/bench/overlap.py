"""``flashpar bench overlap``: every mode of every overlapped op side by side, in one run, on the same shapes.

Ops (``--ops``, see :mod:`flashpar.sim.bench_runs`): the tensor+sequence-parallel pair
(``ag``, ``rs``), the sharded data-parallel linear (``fsdp``) and the Ulysses pair (``qkv``, ``out``).

The parent process starts N gloo ranks (each in its own network namespace behind
a rate-limited link with ``--link-rate``, on loopback otherwise) running
:func:`worker`.  The worker

1. calibrates GEMM rate and link (:mod:`flashpar.cost.calibrate`, plus the executor's own
   overheads per GEMM piece and lane item), rank 0's values for all, and what a transfer in
   flight takes from a GEMM beside it (``comm_cpu_s_per_byte``, the slowest rank's, median of
   pairs; its quartiles in the report's ``comm_cpu``);
2. sizes the shapes: for a target communication/compute ratio (``--ratio``) the free dim that
   sets the GEMM work is scaled from a measured probe, plus a small-M shape;
3. runs, round by round with the order of the variants rotated, each variant three ways:
   overlapped, compute-only and communication-only (:func:`flashpar.overlap.executor.only`),
   forward and backward timed separately after a barrier;
4. reports medians over rounds of the slowest rank's time, and each round's slowest-rank time
   (``samples``: what ``flashpar simulate check`` reads the measurement's own spread from).

Denormal floats are flushed to zero on every rank (:func:`_flush_denormals`): a compute-only run computes
on receive buffers no transfer filled, whose leftover bytes read as up to 10^5 denormal floats, and a
GEMM pays about 5 us (activation operand) to 40 us (weight operand) per denormal element on this CPU.

Columns: ``compute``, ``comm``, ``overlapped``, ``ideal = max(compute, comm)``,
``ovl/ideal``, ``exposed = overlapped - compute``, ``ovl/bound`` with the decomposed bound
``max(C, M + C / (N k))`` for flash and ring (one peer's sub-block of compute must follow
the last transfer), and ``vs none`` = overlapped / overlapped of ``none``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import replace

from flashpar.sim.bench_runs import OP_KEYS, BenchShape, modes_for, with_free

VARIANTS = (("none", None), ("slice", 4), ("ring", 1), ("flash", 1), ("flash", 4), ("auto", None))
DEFAULT_RATIO = {2: 0.4, 3: 0.5, 4: 0.6}


# ----------------------------------------------------------------------------------------------
# worker (one per rank)


def make_call(shape: BenchShape, n: int, dtype):
    """``(fn, x, weight, grad_y)`` for one rank: ``fn(x, weight, **kw)`` is the op (its inputs:
    ``flashpar.sim.bench_runs``' table of the ops)."""
    import torch

    from flashpar.overlap import (
        all_gather_matmul,
        all_to_all_matmul,
        matmul_all_to_all,
        matmul_reduce_scatter,
        sharded_linear,
    )

    s, w, f = shape.seq_local, shape.width, shape.free
    x_shape, w_shape, y_shape, fn = {
        "ag": ((s, w), (f, w), (s * n, f), all_gather_matmul),
        "rs": ((s * n, f), (w, f), (s, w), matmul_reduce_scatter),
        "fsdp": ((s, w), (max(w // n, 1), w), (s, max(w // n, 1) * n), sharded_linear),
        "qkv": ((s, f), (n * w, f), (s * n, w), matmul_all_to_all),
        "out": ((s * n, w), (f, n * w), (s, f), all_to_all_matmul),
    }[shape.op]
    x = torch.randn(*x_shape, dtype=dtype, requires_grad=True)
    weight = torch.randn(*w_shape, dtype=dtype, requires_grad=True)
    return fn, x, weight, torch.randn(*y_shape, dtype=dtype)


def _size_shapes(n: int, ratio: float, seq_local: int, width: int, ops: list[str], dtype) -> list[BenchShape]:
    """Shapes whose forward communication / compute is about ``ratio`` (and 1.5 for comm-heavy).

    The communicated block fixes the communication; the free dim (see :mod:`flashpar.sim.bench_runs`)
    sets the compute and nothing else.  Both are measured on a probe shape with the flash schedule,
    forward only (communication-only and compute-only, slowest rank), and the free dim is scaled so
    that compute = communication / ratio.
    """
    import torch
    import torch.distributed as dist

    probe = 512
    shapes = []
    for op in ops:
        probe_shape = with_free(op, "probe", seq_local, width, probe)
        times = []
        for kind in ("comm", "compute"):
            samples = [_measure(probe_shape, "flash", 1, kind, n, dtype, 1)[0] for _ in range(4)]
            times.append(statistics.median(samples[1:]))  # the first call warms up
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # every rank sizes the same shapes
        comm, compute_per_unit = float(t[0]), float(t[1]) / probe
        for label, r in (("hidden", ratio), ("comm-heavy", 1.5)):
            d = max(16, int(round(comm / r / compute_per_unit / 16)) * 16)
            shapes.append(with_free(op, f"{op}-{label}", seq_local, width, d, r))
    return shapes


def _shapes(n: int, config: dict, dtype) -> list[BenchShape]:
    """The shape families of ``config["shapes"]``: probe-sized hidden / comm-heavy, and small-M (16 rows
    over all ranks, 512 x 512 weights: latency-bound, where ``auto`` should keep ``none``)."""
    families, ops = config["shapes"], config["ops"]
    shapes = []
    if set(families) - {"small-M"}:
        shapes += _size_shapes(n, config["ratio"], config["seq_local"], config["width"], ops, dtype)
    small = max(1, 16 // n)
    shapes += [with_free(op, f"{op}-small-M", small, 512, small if op == "fsdp" else 512) for op in ops]
    return [s for s in shapes if s.name.split("-", 1)[1] in families]


def _measure(shape: BenchShape, mode: str, chunks, kind: str, n: int, dtype, reps: int,
             group=None) -> tuple[float, float]:
    """Mean forward and backward seconds of this rank over ``reps`` back-to-back calls (few-ms ops are
    repeated so that timer and barrier noise do not swamp them)."""
    import torch.distributed as dist

    from flashpar.overlap.executor import only

    op, x, w, grad_y = make_call(shape, n, dtype)
    ctx = only(kind) if kind != "overlapped" else contextlib.nullcontext()
    with ctx:
        dist.barrier(group)
        t0 = time.perf_counter()
        ys = [op(x, w, group=group, mode=mode, chunks=chunks, check=False) for _ in range(reps)]
        t_fwd = time.perf_counter() - t0
        dist.barrier(group)
        t0 = time.perf_counter()
        for y in ys:
            y.backward(grad_y)
        t_bwd = time.perf_counter() - t0
    return t_fwd / reps, t_bwd / reps


def measure_schedule_overheads(group, dtype) -> tuple[float, float]:
    """(seconds per GEMM piece, seconds per lane item) that the executor adds on top of the kernels
    and the wire: dispatch, views and bookkeeping per piece; the hand-off to the lane and back per
    transfer.  Measured on a tiny all_gather_matmul, compute-only flash(k=4) vs none for the piece,
    communication-only flash(k=1) for the item.  Decomposition pays these per piece, which is what
    makes it lose at small M."""
    import torch
    import torch.distributed as dist

    from flashpar.cost.calibrate import median_time
    from flashpar.overlap import all_gather_matmul
    from flashpar.overlap.executor import only

    n = dist.get_world_size(group)
    x, w = torch.randn(4, 64, dtype=dtype), torch.randn(64, 64, dtype=dtype)
    calls = 20

    def per_call(part: str, mode: str, chunks: int) -> float:
        def run():
            with only(part):
                for _ in range(calls):
                    all_gather_matmul(x, w, group=group, mode=mode, chunks=chunks, check=False)
        run()  # warm-up
        return median_time(run, 5, barrier=True, group=group) / calls

    piece = (per_call("compute", "flash", 4) - per_call("compute", "none", 1)) / ((n - 1) * 4)
    item = per_call("comm", "flash", 1) / (n - 1)
    return max(piece, 0.0), item


def _flush_denormals() -> bool:
    """Flush denormal floats to zero (inputs and results, x86 DAZ / FTZ) on this thread and every thread
    started after it (gloo's, the overlap lane's: a new thread inherits the floating-point state).

    The compute-only variant skips the transfers, so its GEMMs and adds read receive buffers holding whatever
    the allocator left there; some of those bytes are denormal floats (counted: 0 to 145,449, median 12, per
    compute-only run of the hidden shapes at N=2, none in any overlapped run) and each costs a microcode
    assist per vector instruction: 5 us per denormal in a [512, 1024] activation, 40-50 us in a [1024, 1024]
    weight, against a 13 ms GEMM.  The overlapped run computes on received values (no denormals), so without
    the flush the compute-only time is inflated by a random amount and can exceed the overlapped run.  Returns
    whether the CPU supports it (False: nothing changed)."""
    import torch

    return bool(torch.set_flush_denormal(True))


def worker(config: dict) -> None:
    import torch
    import torch.distributed as dist

    from flashpar import cost
    from flashpar.cost.calibrate import calibrate, measure_comm_cpu
    from flashpar.overlap.simulate import choose_modes, picks_label, predict

    flushed = _flush_denormals()  # before gloo starts its threads, so they inherit it
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(config["threads"])
    torch.manual_seed(rank)
    dtype = getattr(torch, config["dtype"])
    elem = torch.empty((), dtype=dtype).element_size()
    hw = calibrate(dtype=dtype, overheads=measure_schedule_overheads)
    # what a transfer in flight takes from the GEMM beside it, on these ranks and links (pairs: twice the
    # rows' rounds, 5 to 25, about 0.2 s each)
    comm_cpu = measure_comm_cpu(hw, dtype, pairs=min(25, max(5, 2 * config["rounds"])))
    hw = replace(hw, comm_cpu_s_per_byte=comm_cpu["s_per_byte"])
    if config["calibrate"] and rank == 0:
        path = cost.save(hw, "cpu")
        print(f"calibration stored in {path}", flush=True)
    shapes = _shapes(n, config, dtype)
    variants = [tuple(v) for v in config["variants"]]
    samples: dict[tuple, list] = {}
    reps, rounds = {}, {}
    for shape in shapes:
        sim_op, *dims = shape.sim_args(n)
        t_none = list(predict(sim_op, "none", 1, n, *dims, elem, hw).values())[0].total
        reps[shape.name] = max(1, min(50, int(0.05 / max(t_none, 1e-6))))
        # millisecond ops are at the mercy of scheduler noise on a shared box: 4x the rounds (still cheap)
        rounds[shape.name] = config["rounds"] * (4 if t_none < 5e-3 else 1)
    with cost.use(hw):
        for rnd in range(max(rounds.values(), default=0)):
            for shape in (s for s in shapes if rnd < rounds[s.name]):
                mine = modes_for(shape.op, variants)
                order = mine[rnd % len(mine):] + mine[: rnd % len(mine)]
                for mode, chunks in order:
                    for kind in ("overlapped", "compute", "comm"):
                        t = _measure(shape, mode, chunks, kind, n, dtype, reps[shape.name])
                        samples.setdefault((shape.name, mode, chunks, kind), []).append(t)
    gathered = [None] * n
    dist.all_gather_object(gathered, samples)
    if rank == 0:
        report = {"world_size": n, "link_rate": config["link_rate"], "dtype": config["dtype"],
                  "threads": config["threads"], "rounds": config["rounds"], "hardware": hw.__dict__,
                  "comm_cpu": comm_cpu, "denormals_flushed": flushed, "shapes": []}
        for shape in shapes:
            entry = {"shape": shape.__dict__, "describe": shape.describe(n), "reps": reps[shape.name],
                     "rounds": rounds[shape.name], "modes": []}
            sim_op, *dims = shape.sim_args(n)
            auto_fwd, auto_bwd = choose_modes(sim_op, n, *dims, elem, "cpu", hw)  # as the op runs: regathering
            for mode, chunks in modes_for(shape.op, variants):
                row = {"mode": mode, "chunks": chunks}
                if mode == "auto":
                    row["picked"] = picks_label(auto_fwd, auto_bwd)
                for d, direction in enumerate(("forward", "backward")):
                    med, per_round = {}, {}
                    for kind in ("overlapped", "compute", "comm"):
                        per_round[kind] = [max(gathered[r][(shape.name, mode, chunks, kind)][i][d] for r in range(n))
                                           for i in range(rounds[shape.name])]
                        med[kind] = statistics.median(per_round[kind])
                    row[direction] = {**_figures(med, n, mode, chunks), "samples": per_round}
                fwd, bwd = (auto_fwd, auto_bwd) if mode == "auto" else ((mode, chunks or 1, 1),) * 2
                pred_f = predict(sim_op, fwd[0], fwd[1], n, *dims, elem, hw, peers_per_piece=fwd[2])
                pred_b = predict(sim_op, bwd[0], bwd[1], n, *dims, elem, hw, peers_per_piece=bwd[2])
                row["predicted"] = {sim_op: pred_f[sim_op].total, f"{sim_op}_bwd": pred_b[f"{sim_op}_bwd"].total}
                entry["modes"].append(row)
            none = next((m for m in entry["modes"] if m["mode"] == "none"), None)
            for m in entry["modes"]:
                for direction in ("forward", "backward"):
                    base = none[direction]["overlapped"] if none else float("nan")
                    m[direction]["vs_none"] = m[direction]["overlapped"] / base
            report["shapes"].append(entry)
        with open(config["out"], "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def _figures(med: dict, n: int, mode: str, chunks) -> dict:
    c, m, o = med["compute"], med["comm"], med["overlapped"]
    ideal = max(c, m)
    fig = {"compute": c, "comm": m, "overlapped": o, "ideal": ideal, "ovl_ideal": o / ideal, "exposed": o - c}
    if mode in ("flash", "ring"):
        bound = max(c, m + c / (n * (chunks or 1)))
        fig["bound"] = bound
        fig["ovl_bound"] = o / bound
    return fig


# ----------------------------------------------------------------------------------------------
# parent


def format_report(report: dict) -> str:
    n = report["world_size"]
    lines = [f"== N={n} ranks, link {report['link_rate']}, {report['dtype']}, {report['threads']} thread(s)/rank, "
             f"median of {report['rounds']} rounds (slowest rank), times in ms =="]
    hw = report["hardware"]
    lines.append(f"calibration: GEMM {hw['flops'] / 1e9:.1f} GFLOP/s, link {hw['link_bytes_per_s'] / 1e6:.1f} MB/s, "
                 f"latency {hw['link_latency_s'] * 1e6:.0f} us")
    if "comm_cpu" in report:
        c = report["comm_cpu"]
        lines.append(f"a transfer beside a GEMM takes {hw['comm_cpu_s_per_byte'] * 1e9:.2f} ns of it per byte moved "
                     f"(quartiles {c['q25'] * 1e9:.2f} to {c['q75'] * 1e9:.2f}, {c['pairs']} pairs of "
                     f"{c['gemm_s'] * 1e3:.0f} ms GEMMs, {c['bytes_moved'] / 1e6:.1f} MB moved beside each)")
    head = f"{'mode':<12}{'dir':<5}{'compute':>9}{'comm':>9}{'overlap':>9}{'ideal':>9}{'ovl/ideal':>10}" \
           f"{'exposed':>9}{'ovl/bound':>10}{'vs none':>9}{'model':>8}"
    for entry in report["shapes"]:
        lines.append("")
        lines.append(f"{entry['describe']}  [{entry['rounds']} rounds x {entry['reps']} calls]")
        lines.append(head)
        for m in entry["modes"]:
            label = m["mode"] + (f"(k={m['chunks']})" if m["chunks"] else "")
            if m["mode"] == "auto":
                label = f"auto>{m['picked'].split('(')[0]}"
            for direction, short, pkey in (("forward", "fwd", 0), ("backward", "bwd", 1)):
                f = m[direction]
                bound = f"{f['ovl_bound']:>10.2f}" if "ovl_bound" in f else f"{'-':>10}"
                model = list(m["predicted"].values())[pkey] * 1e3
                lines.append(f"{label:<12}{short:<5}{f['compute'] * 1e3:>9.2f}{f['comm'] * 1e3:>9.2f}"
                             f"{f['overlapped'] * 1e3:>9.2f}{f['ideal'] * 1e3:>9.2f}{f['ovl_ideal']:>10.2f}"
                             f"{f['exposed'] * 1e3:>9.2f}{bound}{f['vs_none']:>9.2f}{model:>8.2f}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", default="2", help="comma-separated world sizes, e.g. 2,4 (default 2)")
    p.add_argument("--link-rate", default="1gbit",
                   help="emulated per-rank link (tc rate, e.g. 1gbit); 'none' = loopback (default 1gbit)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ratio", type=float, default=None,
                   help="target forward comm/compute of the 'hidden' shapes (default 0.4 at N=2, 0.6 at N=4)")
    p.add_argument("--seq-local", type=int, default=512, help="sequence rows per rank")
    p.add_argument("--width", type=int, default=1024, help="features of the communicated tensor")
    p.add_argument("--modes", default=None,
                   help="variants as mode[:chunks], comma-separated (default none,slice:4,ring:1,flash:1,flash:4,auto)")
    p.add_argument("--ops", default=",".join(OP_KEYS),
                   help="ops to compare: ag, rs (tensor parallel), fsdp (sharded data parallel), qkv, out "
                        "(Ulysses all-to-all) (default all)")
    p.add_argument("--shapes", default="hidden,comm-heavy,small-M",
                   help="which shape families to run: hidden, comm-heavy, small-M (default all)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--calibrate", action="store_true",
                   help="store the measured figures in the calibration file that mode='auto' reads "
                   "(~/.cache/flashpar/hardware.json; see flashpar.cost.store)")
    p.add_argument("--json", default=None, help="write the results (all world sizes) to this JSON file")
    p.add_argument("--timeout", type=float, default=1800.0)


def _parse_variants(text: str | None) -> list[tuple[str, int | None]]:
    if not text:
        return list(VARIANTS)
    out = []
    for item in text.split(","):
        mode, _, k = item.strip().partition(":")
        out.append((mode, int(k) if k else None))
    return out


def run(args: argparse.Namespace) -> int:
    from flashpar.bench.launch import run_workers, save_json
    from flashpar.bench.netlink import chosen_rate

    sizes = [int(v) for v in str(args.nproc).split(",") if v.strip()]
    if any(s < 2 for s in sizes):
        print("flashpar bench overlap: --nproc needs world sizes >= 2", file=sys.stderr)
        return 2
    variants = _parse_variants(args.modes)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OP_KEYS]
    if unknown:
        print(f"flashpar bench overlap: unknown --ops {unknown}; expected some of {OP_KEYS}", file=sys.stderr)
        return 2
    rate = chosen_rate(args.link_rate)
    reports = []
    for n in sizes:
        config = {"threads": args.threads, "dtype": args.dtype, "calibrate": args.calibrate,
                  "ratio": args.ratio or DEFAULT_RATIO.get(n, 0.6), "seq_local": args.seq_local,
                  "width": args.width, "rounds": args.rounds, "variants": variants,
                  "shapes": args.shapes.split(","), "ops": ops}
        report = run_workers("flashpar.bench.overlap", n, config, rate, timeout=args.timeout)
        report["command"] = " ".join(["flashpar bench overlap", *sys.argv[3:]]) if len(sys.argv) > 2 else ""
        reports.append(report)
        print(format_report(report), flush=True)
    save_json(args.json, reports)
    return 0


if __name__ == "__main__":
    from flashpar.bench.launch import module_main

    module_main("flashpar bench overlap", add_arguments, run, worker)
