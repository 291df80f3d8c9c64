"""The training loop of one rank: mesh, model, data, steps and their bookkeeping (see ``flashpar.train.run``).

Per step, on every rank of the (dp, cp, ulysses, tp) mesh: the dp rank's ``M = --micro-batches`` packed
sequences and their plans (made in a data-loader worker), this cp rank's tokens of each, and
``checked_step`` (``flashpar.train.nonfinite``: ``flashpar.train.step``'s optimizer step, skipped or stopped
when its loss or gradient norm is not finite; per micro-batch the model's forward on this ulysses and
tp rank's rows, which the model takes from the cp rank's tokens, the next-token loss normalised by the
global batch's targets, backward; the gradients summed over copies once, clipped by their global norm
(``--clip``), AdamW at the step's rate (``flashpar.train.schedule``)).  Around it the loop keeps the books:
rank 0 reports a ``StepMetrics`` (loss summed over ranks, learning rate, gradient norm, tokens/s, MFU,
the K/V the plans moved) to ``metrics.jsonl`` and the progress bar; checkpoints, the trace of the third
step and the plot.  ``Hooks`` are callables the loop runs on every rank (fault injection for failure
drills and tests).

Data.  Dp rank ``d``'s micro-batch ``m`` of step ``s`` (0-based, counted from the run's first step) is
the global sequence ``start + (s M + m) dp + d``: ``PlannedSequences`` item ``s M + m`` of the dp rank,
taken ``M`` at a time (``group_micro_batches``); ``start`` is 0, or the checkpoint's ``sequences``
(``checkpoint.sequences_after``) when resuming.

    MFU = model FLOPs per second / (peak FLOP/s per rank x ranks)        (CUDA: the GPU's datasheet peak)
    model FLOPs of a step = sum over the M x dp sequences of T * cfg.flops_per_token(pairs / T)

``pairs`` is the causal document mask's (query, key) pairs of the sequence.  A CPU has no vendor peak:
there the run reports the model FLOP/s and no MFU (``flashpar.train.metrics``).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from flashpar import cp
from flashpar.cost.calibrate import peak_flops
from flashpar.links import planning_device
from flashpar.mesh import init_world
from flashpar.models.compiling import warm_up
from flashpar.train import checkpoint, watchdog, where
from flashpar.train.config import TrainConfig
from flashpar.train.data import PlannedSequences, make_loader, training_data
from flashpar.train.evaluate import at_step, held_out
from flashpar.train.metrics import StepMetrics, largest, peak_since, reset_peak, summary
from flashpar.train.nonfinite import NonFiniteGuard, StepTotals, checked_step
from flashpar.train.planning import group_figures, planner_cost, resolve_options
from flashpar.train.schedule import lr_at
from flashpar.train.step import MicroBatch, build
from flashpar.train.stop import JobStop


@dataclass(frozen=True)
class Hooks:
    """Callables ``train`` runs on every rank.  The launcher pickles them into the spawned ranks: use
    module-level functions (or ``functools.partial`` of them)."""

    before_step: Callable[[int], None] | None = None  # called with the 1-based step about to run
    on_model: Callable[[int, object], None] | None = None  # the same, with the rank's model (drills poison a step)


def setup(config: TrainConfig):
    """Process group, device and mesh of this rank."""
    cuda = config.device == "cuda"
    if not dist.is_initialized():
        init_world("nccl" if cuda else "gloo", datetime.timedelta(seconds=config.timeout))
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(config.threads)
    mesh = config.dims.mesh(device.type)  # dims named flashpar.dims.DIMS
    return device, mesh


def train(config: TrainConfig, hooks: Hooks | None = None) -> dict | None:
    """Train on this rank (every rank calls it); rank 0 returns the summary, the others ``None``."""
    hooks = hooks or Hooks()
    device, mesh = setup(config)
    where.install(Path(config.out) / ".where", dist.get_rank())  # what a peer that times out reads
    rank, world = dist.get_rank(), dist.get_world_size()
    dog = watchdog.start(config.watchdog_s, rank, world)  # --watchdog: armed from the first step
    figures = planning_device(device.type, config.tp * config.ulysses)  # rank 0's, on every rank: read once
    options = resolve_options(config, device.type, figures)  # ZeRO-3's auto choices made on them
    cfg, model, opt = build(config, mesh, device, options)
    compiled = warm_up(model)  # --compile: the regions compiled now, timed apart from the steps
    if compiled is not None:
        compiled = compiled.slowest(device)
        if rank == 0:
            print(compiled.line(), flush=True)
    dp_group = mesh["dp"].get_group()
    dp_rank, cp_rank = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    data = training_data(config)  # the byte corpus, or the token cache of --data / --tokenizer
    hw, burst = figures
    cp_hw = group_figures(hw, config.dims, ("cp",), device.type)  # the cp group's link: the K/V it plans for
    cost = planner_cost(cfg, options.dtype_bytes, hardware=cp_hw, burst=burst)
    evaluator = held_out(config, cost, mesh, device)  # --eval-every: the held-out sequences, planned once
    first_step, start = 0, 0
    if config.resume:
        meta = checkpoint.read_meta(Path(config.resume), config)
        try:
            checkpoint.load(Path(config.resume), model, opt)  # its files checked first, on every rank
        except checkpoint.BrokenCheckpoint as err:
            raise JobStop(str(err)) from None
        first_step, start = meta["step"], meta["sequences"]
    guard = NonFiniteGuard(config.skip_nonfinite)  # a non-finite step: skipped (--skip-nonfinite N) or the end
    planned = PlannedSequences(data, config.cp, config.strategy, cost, dp_rank=dp_rank, dp_size=config.dp,
                               start=start, epochs=config.epochs)
    micro = config.micro_batches
    left = planned.steps(micro)  # whole global batches: the same count on every dp rank
    steps = first_step + min(config.steps - first_step, left)
    if steps < config.steps and rank == 0:  # one pass over the data: say so now, not only at the end
        print(f"flashpar train: warning: the training data hold {left} more steps of dp x "
              f"micro-batches = {config.dp} x {micro} sequences: the run will stop at step {steps}, before --steps "
              f"{config.steps} ({_passes(config.epochs)}; add documents, raise --epochs or lower --steps)",
              file=sys.stderr, flush=True)
    loader = make_loader(planned, num_workers=config.workers)
    peak = peak_flops(device) if device.type == "cuda" else None  # CPU: no vendor peak, no MFU (train.metrics)
    out = Path(config.out)
    log = open(out / "metrics.jsonl", "a" if first_step else "w") if rank == 0 else None  # noqa: SIM115
    bar = _progress(steps, first_step) if rank == 0 else None
    history: list[StepMetrics] = []
    mem_step, mem_mb = first_step + 1 if steps - first_step > 1 else first_step, float("nan")  # peak of this step
    t_start = time.perf_counter()
    for step, items in zip(range(first_step, steps), group_micro_batches(loader, micro), strict=False):
        where.begin_step(step + 1)
        if hooks.before_step is not None:
            hooks.before_step(step + 1)
        if hooks.on_model is not None:
            hooks.on_model(step + 1, model)
        batch = [MicroBatch(cp.shard(it["tokens"], it["plan"], cp_rank).to(device),
                            cp.shard(it["labels"], it["plan"], cp_rank).to(device), it["plan"]) for it in items]
        count, pairs, figures = _batch_figures(items, dp_group, device)
        lr = lr_at(step + 1, lr=config.lr, steps=config.steps, warmup=config.warmup, lr_min=config.final_lr)
        sent0 = model.kv_counter.fwd_sent
        mem_before = reset_peak(device) if step == mem_step else None  # outside the timed step
        profiler = _profiler(config, device) if step == min(first_step + 2, steps - 1) else None
        t0 = time.perf_counter()
        with profiler or contextlib.nullcontext():  # the loss summed over the ranks: before AdamW (nonfinite.py)
            totals = checked_step(model, opt, batch, count, clip=config.clip, lr=lr, step=step + 1, guard=guard,
                                  kv_sent=lambda s0=sent0: model.kv_counter.fwd_sent - s0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step's kernels, not only their launches, in step_s
        elapsed = time.perf_counter() - t0
        if mem_before is not None:
            mem_mb = peak_since(device, mem_before)
        if profiler is not None:
            profiler.export_chrome_trace(str(out / f"trace_rank{rank}.json"))
        planning_ms = 1e3 * sum(it["planning_s"] for it in items)
        metrics = _measure(step + 1, totals, elapsed, config, pairs, peak and peak * world, planning_ms, figures,
                           lr=lr, device=device)
        if totals.skipped:  # --skip-nonfinite: a row that says so, no figures in the summary
            if rank == 0:
                log.write(json.dumps(_skipped_row(totals, step + 1, lr)) + "\n")
                log.flush()
                bar.update(1)
        else:
            where.enter("evaluate")
            metrics = at_step(evaluator, model, metrics, step + 1, steps)  # eval_loss every --eval-every steps, last
        if rank == 0 and not totals.skipped:
            history.append(metrics)
            log.write(json.dumps(metrics.row()) + "\n")
            log.flush()
            bar.update(1)
            bar.set_postfix(**metrics.postfix(), eta=eta([m.step_s for m in history], steps - step - 1))
        if config.save_every and ((step + 1) % config.save_every == 0 or step + 1 == steps):
            sequences = checkpoint.sequences_after(start, step + 1 - first_step, config.dp, micro)
            where.enter("save")
            checkpoint.save(out / "checkpoints" / f"step_{step + 1}", model, opt, step + 1, config, sequences,
                            keep=config.keep)
    if dog is not None:
        dog.stop()  # the steps are done: what follows is bounded by --timeout
    result = None
    wall_s, mem_mb = time.perf_counter() - t_start, largest(mem_mb, device)  # a collective
    if rank == 0:
        bar.close()
        log.close()
        result = summary(history, wall_s, config, peak, peak_mem_mb=mem_mb)
        result["options"] = options.to_dict()  # the run's, its set-up choices made
        if compiled is not None:  # the start-up compilation, and any graph compiled during the steps
            result.update(compiled.to_dict())
        result["skipped_nonfinite"] = guard.skipped
        result["data_ran_out_at"] = steps if steps < config.steps else None  # the report says so
        if config.plot and history:
            from flashpar.train.report import plot

            plot([m.row() for m in history], items[-1]["plan"], out / "train.png")
            result["plot"] = str(out / "train.png")
        (out / "summary.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    return result


def _passes(epochs: int) -> str:
    return "each sequence is used once" if epochs == 1 else f"--epochs {epochs}: each sequence is used {epochs} times"


def group_micro_batches(items, micro_batches: int):
    """The loader's items ``micro_batches`` at a time (lists), in order; a last incomplete group is dropped."""
    it = iter(items)
    while len(group := list(itertools.islice(it, micro_batches))) == micro_batches:
        yield group


def _batch_figures(items: list[dict], dp_group, device) -> tuple[float, float, dict[str, float]]:
    """The global batch's targets (the loss's divisor), causal mask pairs and plan figures: summed over the
    micro-batches (they run one after the other) and the dp ranks (times: the slowest dp rank).  A
    collective over dp, before the step (on ``device``: NCCL reduces only device tensors)."""
    figures = {k: sum(it["figures"][k] for it in items) for k in items[0]["figures"]}  # made in the loader worker
    summed = [k for k in figures if k.endswith("bytes")]
    slowest = [k for k in figures if k not in summed]
    targets = sum(float((it["labels"] != -100).sum()) for it in items)
    sums = torch.tensor([targets, sum(_pairs(it["plan"]) for it in items), *(figures[k] for k in summed)],
                        dtype=torch.float64, device=device)
    worst = torch.tensor([figures[k] for k in slowest], dtype=torch.float64, device=device)
    dist.all_reduce(sums, group=dp_group)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=dp_group)
    figures.update(zip(summed, sums[2:].tolist(), strict=True))
    figures.update(zip(slowest, worst.tolist(), strict=True))
    return float(sums[0]), float(sums[1]), figures  # host values: read between steps


def _measure(step: int, totals: StepTotals, elapsed: float, config: TrainConfig, pairs: float,
             peak_total: float | None,
             planning_ms: float, figures: dict[str, float], *, lr: float, device) -> StepMetrics:
    """The step's figures over every rank: the loss and K/V bytes summed and the gradient norm come from the
    step (``nonfinite.checked_step``: summed there, before AdamW); the time of the slowest rank is reduced
    here (a collective, after the step)."""
    slowest = torch.tensor([elapsed], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    tokens = config.seq_len * config.dp * config.micro_batches  # the global batch
    step_s = float(slowest[0])
    flops = tokens * config.model.flops_per_token(pairs / tokens)
    return StepMetrics(step=step, loss=totals.loss, step_s=step_s, tokens_per_s=tokens / step_s,
                       model_flops_per_s=flops / step_s,
                       mfu=None if peak_total is None else flops / step_s / peak_total,
                       kv_bytes=totals.kv_bytes, planning_ms_dp0=planning_ms, plan=figures, lr=lr,
                       grad_norm=totals.grad_norm)


def _skipped_row(totals: StepTotals, step: int, lr: float) -> dict:
    """metrics.jsonl's row of a step skipped for a non-finite loss or gradient norm (as strings: JSON has no NaN)."""
    return {"step": step, "skipped": "non-finite", "loss": str(totals.loss), "grad_norm": str(totals.grad_norm),
            "lr": lr}


def _profiler(config: TrainConfig, device):
    """torch.profiler over one step (the third) when ``--trace``: a Chrome / Perfetto trace per rank."""
    if not config.trace:
        return None
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities, record_shapes=False)


def _pairs(plan) -> float:
    """(query, key) pairs of the causal document mask of the whole sequence."""
    return float(sum(n * (n + 1) // 2 for n in plan.doc_lens))


WARM_STEPS = 2  # steps left out of the ETA: the first ones start the workers, allocate, warm the caches


def eta(step_times: list[float], left: int) -> str:
    """The time the ``left`` steps still take: the median of the steps after the first ``WARM_STEPS`` (the first
    step of a run takes many times a later one: its ETA would be hours off), as ``h:mm:ss``; ``"warming up"``
    before there is one."""
    timed = sorted(step_times[WARM_STEPS:])
    if not timed:
        return "warming up"
    seconds = round(timed[len(timed) // 2] * left)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _progress(total: int, done: int = 0):
    """rank 0's bar: steps and elapsed time; the ETA is a postfix (``eta``), tqdm's own rate counts the first
    steps."""
    try:
        from tqdm import tqdm

        return tqdm(total=total, initial=done, desc="train", unit="step", dynamic_ncols=True,
                    bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
    except ImportError:  # pragma: no cover - tqdm is a dependency; keep running without it
        class _Plain:
            def update(self, n): pass
            def set_postfix(self, **kw): print(" ".join(f"{k}={v}" for k, v in kw.items()), flush=True)
            def close(self): pass
        return _Plain()
