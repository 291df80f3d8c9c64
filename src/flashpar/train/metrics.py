"""What a training step reports (``StepMetrics``: one line of ``metrics.jsonl``, the progress bar) and the
run's ``summary.json``.

    tokens_per_s      = micro-batches x dp x seq_len / step_s
    model_flops_per_s = model FLOPs of the step / step_s                  (every rank together)
    MFU               = model_flops_per_s / (peak FLOP/s per GPU x ranks)  (CUDA only: the datasheet's peak)

A CPU has no vendor peak that its ranks could be measured against (a GEMM probe of each rank's share of the
cores reads 80% "MFU" on small models: a fraction of what a small GEMM does, not of the machine), so on CPU
``mfu`` is None and the run reports ``model_flops_per_s`` instead.
    peak_mem_mb  = the largest rank's rise of memory during one step (the second; the first when the run
                   has one) above what the rank held before it (weights, gradients' storage, AdamW state,
                   data): activations and transient buffers.  CPU: the resident set's peak (VmHWM, reset
                   as ``flashpar bench train`` does); CUDA: torch.cuda.max_memory_allocated
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """One step, as rank 0 reports it (every figure already reduced over the ranks)."""

    step: int  # 1-based
    loss: float  # mean next-token loss of the global batch (nats): the ranks' shares summed
    step_s: float  # wall time of the optimizer step (all its micro-batches) on the slowest rank
    tokens_per_s: float  # global batch tokens / step_s
    model_flops_per_s: float  # model FLOPs of the global batch / step_s
    mfu: float | None  # model_flops_per_s / (peak per GPU x ranks); None on CPU (no vendor peak)
    kv_bytes: int  # forward K/V bytes cp.attention sent, all ranks and layers (measured at the transport)
    planning_ms_dp0: float  # the planner's time for dp rank 0's sequences of the step (in its data-loader worker)
    plan: dict[str, float]  # the plans' figures (train.data.plan_figures): bytes summed over dp, times the slowest
    # the optimizer
    lr: float  # the step's learning rate (flashpar.train.schedule)
    grad_norm: float  # global gradient norm before clipping (flashpar.models.grad_norm)
    eval_loss: float | None = None  # validation loss on the held-out documents, at evaluation steps (train.evaluate)

    def row(self) -> dict:
        """The ``metrics.jsonl`` line: the fields, with ``plan``'s entries flattened in."""
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}
        if self.eval_loss is None:  # only the rows of evaluation steps carry it
            del row["eval_loss"]
        return {**row, **self.plan}

    def postfix(self) -> dict[str, str]:
        """The progress bar's figures."""
        shown = {"eval": f"{self.eval_loss:.3f}"} if self.eval_loss is not None else {}
        return {"loss": f"{self.loss:.3f}", **shown, "gnorm": f"{self.grad_norm:.2f}",
                "tok_s": f"{self.tokens_per_s:.0f}", **self._rate(), "kv": f"{self.kv_bytes / 1e6:.1f}MB",
                "exposed": f"{self.plan['exposed_comm_ms_est']:.3f}ms"}


    def _rate(self) -> dict[str, str]:
        if self.mfu is None:
            return {"gflop_s": f"{self.model_flops_per_s / 1e9:.1f}"}
        return {"mfu": f"{self.mfu:.1%}"}


def reset_peak(device) -> int:
    """Start measuring this rank's peak memory; returns the baseline ``peak_since`` takes (CPU: kB resident,
    CUDA: bytes allocated)."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    from flashpar.peak_memory import reset_peak_memory

    return reset_peak_memory()


def peak_since(device, before: int) -> float:
    """MB this rank's peak memory rose above ``before`` since ``reset_peak`` (no collective)."""
    import torch

    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    from flashpar.peak_memory import peak_memory

    return peak_memory(before)


def largest(value: float, device) -> float:
    """The largest rank's ``value`` (a collective over the world; NaN on a rank that measured nothing)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def summary(history: list[StepMetrics], wall_s: float, config, peak: float, *,
            peak_mem_mb: float = float("nan")) -> dict:
    """``summary.json``: the run's totals (``*_bytes``: summed over its steps; ``steps_s``: the steps' own time,
    ``wall_s``: the loop's, with loading data, evaluating and saving), the cost model's step times
    (``*est_step_ms``: the mean over its steps), the last five steps' mean speed, the largest rank's peak
    memory, the mesh, the dtype."""
    rows = [m.row() for m in history]
    last = rows[-5:] or [{}]
    mean = lambda key: sum(r[key] for r in last) / len(last) if rows else float("nan")  # noqa: E731
    total = lambda key: sum(r[key] for r in rows)  # noqa: E731
    mean_all = lambda key: total(key) / len(rows) if rows else float("nan")  # noqa: E731
    return {
        "steps": len(rows), "wall_s": wall_s, "steps_s": total("step_s"),
        "final_loss": rows[-1]["loss"] if rows else float("nan"),
        "first_loss": rows[0]["loss"] if rows else float("nan"),
        "tokens_per_s": mean("tokens_per_s"), "model_flops_per_s": mean("model_flops_per_s"),
        "mfu": None if peak is None else mean("mfu"), "peak_flops_per_rank": peak,
        "kv_bytes": total("kv_bytes"), "plan_kv_bytes": total("plan_kv_bytes"),
        "per_doc_kv_bytes": total("per_doc_kv_bytes"), "headtail_kv_bytes": total("headtail_kv_bytes"),
        # the cost model's step time, the mean over the run's steps (per_doc's and headtail's on the same documents)
        "est_step_ms": mean_all("est_step_ms"), "per_doc_est_step_ms": mean_all("per_doc_est_step_ms"),
        "headtail_est_step_ms": mean_all("headtail_est_step_ms"),
        "mesh": {"dp": config.dp, "cp": config.cp, "ulysses": config.ulysses, "tp": config.tp},
        "micro_batches": config.micro_batches,
        "strategy": config.strategy,
        "peak_mem_mb": peak_mem_mb, "dtype": config.dtype, "checkpoint_activations": config.checkpoint_activations,
        "out": config.out,
        "eval_loss": next((r["eval_loss"] for r in reversed(rows) if "eval_loss" in r), None),  # the last one
        "eval": [[r["step"], r["eval_loss"]] for r in rows if "eval_loss" in r],  # [step, validation loss]
    }
