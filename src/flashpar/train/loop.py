"""The training loop of one rank: mesh, model, data, steps, metrics (see ``flashpar.train.run``).

Per step, on every rank of the (dp, cp, tp) mesh: the dp rank's packed sequence and its plan (made
in a data-loader worker), this cp rank's tokens, the model's forward on this tp rank's rows, the
next-token loss normalised by the global batch's targets, backward, gradients summed over copies,
AdamW.  Rank 0 reports loss (summed over ranks), tokens/s, MFU and the K/V the plans moved, and
writes one JSON line per step.

    MFU = model FLOPs per second / (peak FLOP/s per rank x ranks)
    model FLOPs of a step = sum over sequences of T * cfg.flops_per_token(pairs / T)

``pairs`` is the causal document mask's (query, key) pairs of the sequence.  The peak is a GEMM
probe on CPU (every rank at once, so it is each rank's share of the cores) or the datasheet
figure of the GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from flashpar import cp
from flashpar.cost.calibrate import peak_flops
from flashpar.cp import CostModel
from flashpar.models import Llama, LlamaConfig
from flashpar.models.parallel import ParallelLlama
from flashpar.train import checkpoint
from flashpar.train.data import PackedCorpus, PlannedSequences, make_loader


def setup(config: dict):
    """Process group, device and mesh of this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    cuda = config["device"] == "cuda"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=config["timeout"]))
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(config["threads"])
    mesh = init_device_mesh(device.type, (config["dp"], config["cp"], config["tp"]), mesh_dim_names=("dp", "cp", "tp"))
    return device, mesh


def build(config: dict, mesh, device):
    cfg = LlamaConfig(**config["model"])
    torch.manual_seed(config["seed"])
    full = Llama(cfg)  # every rank the same weights; each keeps its shards
    model = ParallelLlama(cfg, mesh, mode=config["mode"], timeout_s=config["timeout"],
                          dp_mode=config.get("dp_mode", "zero3"))
    model.load_full(full)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    return cfg, model, opt


def train(config: dict) -> dict | None:
    device, mesh = setup(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, model, opt = build(config, mesh, device)
    dp_group = mesh["dp"].get_group()
    dp_rank, cp_rank = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    data = PackedCorpus(config["seq_len"], max_docs=config["max_docs"], seed=config["seed"])
    # the planner's cost model with this model's shape (fp32 activations); device rates stay the defaults
    cost = CostModel(hidden=cfg.hidden, ffn=cfg.ffn, heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                     layers=cfg.layers, dtype_bytes=4)
    first_step, start = 0, 0
    if config.get("resume"):
        meta = checkpoint.read_meta(Path(config["resume"]), config)
        checkpoint.load(Path(config["resume"]), model, opt)
        first_step, start = meta["step"], meta["sequences"]
    planned = PlannedSequences(data, config["cp"], config["strategy"], cost, dp_rank=dp_rank, dp_size=config["dp"],
                               start=start)
    steps = first_step + min(config["steps"] - first_step, len(planned))
    loader = make_loader(planned, num_workers=config["workers"])
    peak = peak_flops(device)
    out = Path(config["out"])
    log = open(out / "metrics.jsonl", "a" if first_step else "w") if rank == 0 else None  # noqa: SIM115
    bar = _progress(steps, first_step) if rank == 0 else None
    history, t_start = [], time.perf_counter()
    crash = os.environ.get("FLASHPAR_CRASH_AT", "")  # "rank:step": that rank dies there (failure drills, tests)
    for step, item in zip(range(first_step, steps), loader, strict=False):
        if crash == f"{rank}:{step + 1}":
            os._exit(17)
        plan = item["plan"]
        tokens = cp.shard(item["tokens"], plan, cp_rank).to(device)
        labels = cp.shard(item["labels"], plan, cp_rank).to(device)
        savings = dict(item["figures"])  # made in the loader worker
        summed = [k for k in savings if k.endswith("bytes")]  # over the dp sequences; times: the slowest
        figures = torch.tensor([float((item["labels"] != -100).sum()), _pairs(plan), *(savings[k] for k in summed)],
                               dtype=torch.float64)
        slowest = torch.tensor([v for k, v in savings.items() if k not in summed], dtype=torch.float64)
        dist.all_reduce(figures, group=dp_group)  # targets, mask pairs and plan bytes of the global batch
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=dp_group)
        savings.update(zip(summed, figures[2:].tolist(), strict=True))
        savings.update(zip([k for k in savings if k not in summed], slowest.tolist(), strict=True))
        sent0 = model.kv_counter.fwd_sent
        profiler = _profiler(config, device) if step == min(first_step + 2, steps - 1) else None
        t0 = time.perf_counter()
        with profiler or contextlib.nullcontext():
            loss = model(tokens, plan, labels, float(figures[0]))
            loss.backward()
            model.reduce_grads()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if profiler is not None:
            profiler.export_chrome_trace(str(out / f"trace_rank{rank}.json"))
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        stats = torch.tensor([loss.item(), model.kv_counter.fwd_sent - sent0],
                             dtype=torch.float64)
        dist.all_reduce(stats)  # loss: each rank's share of the global mean; forward K/V bytes: every rank's
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        stats = torch.cat([stats, elapsed])
        if rank == 0:
            tokens_step = config["seq_len"] * config["dp"]
            flops = tokens_step * cfg.flops_per_token(float(figures[1]) / tokens_step)
            row = {"step": step + 1, "loss": float(stats[0]), "step_s": float(stats[2]),
                   "tokens_per_s": tokens_step / float(stats[2]), "mfu": flops / float(stats[2]) / (peak * world),
                   "kv_bytes": int(stats[1]),
                   "planning_ms_dp0": 1e3 * item["planning_s"], **savings}
            history.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}", mfu=f"{row['mfu']:.1%}",
                            kv=f"{row['kv_bytes'] / 1e6:.1f}MB", exposed=f"{row['exposed_comm_ms_est']:.3f}ms")
        every = config.get("save_every") or 0
        if every and ((step + 1) % every == 0 or step + 1 == steps):
            checkpoint.save(out / "checkpoints" / f"step_{step + 1}", model, opt, step + 1, config)
    summary = None
    if rank == 0:
        bar.close()
        log.close()
        summary = _summary(history, time.perf_counter() - t_start, config, peak)
        if config.get("plot") and history:
            from flashpar.train.report import plot

            plot(history, plan, out / "train.png")
            summary["plot"] = str(out / "train.png")
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    dist.barrier()
    return summary


def _profiler(config: dict, device):
    """torch.profiler over one step (the third) when ``--trace``: a Chrome / Perfetto trace per rank."""
    if not config.get("trace"):
        return None
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities, record_shapes=False)


def _pairs(plan) -> float:
    """(query, key) pairs of the causal document mask of the whole sequence."""
    return float(sum(n * (n + 1) // 2 for n in plan.doc_lens))


def _progress(total: int, done: int = 0):
    try:
        from tqdm import tqdm

        return tqdm(total=total, initial=done, desc="train", unit="step", dynamic_ncols=True)
    except ImportError:  # pragma: no cover - tqdm is a dependency; keep running without it
        class _Plain:
            def update(self, n): pass
            def set_postfix(self, **kw): print(" ".join(f"{k}={v}" for k, v in kw.items()), flush=True)
            def close(self): pass
        return _Plain()


def _summary(history: list[dict], wall_s: float, config: dict, peak: float) -> dict:
    last = history[-5:] or [{}]
    mean = lambda key: sum(r[key] for r in last) / len(last) if history else float("nan")  # noqa: E731
    total = lambda key: sum(r[key] for r in history)  # noqa: E731
    return {
        "steps": len(history), "wall_s": wall_s, "final_loss": history[-1]["loss"] if history else float("nan"),
        "first_loss": history[0]["loss"] if history else float("nan"),
        "tokens_per_s": mean("tokens_per_s"), "mfu": mean("mfu"), "peak_flops_per_rank": peak,
        "kv_bytes": total("kv_bytes"), "plan_kv_bytes": total("plan_kv_bytes"),
        "per_doc_kv_bytes": total("per_doc_kv_bytes"), "headtail_kv_bytes": total("headtail_kv_bytes"),
        "est_step_ms": total("est_step_ms"), "per_doc_est_step_ms": total("per_doc_est_step_ms"),
        "headtail_est_step_ms": total("headtail_est_step_ms"),
        "mesh": {"dp": config["dp"], "cp": config["cp"], "tp": config["tp"]}, "strategy": config["strategy"],
        "out": config["out"],
    }
