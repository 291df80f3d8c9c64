"""Part ``train``: ``flashpar train`` on one device at world size 1: ``--check``, then a short run.

On CUDA the process group is NCCL with one rank (the only NCCL group one GPU can host: a second
rank would need a second GPU, so every multi-rank figure comes from ``flashpar simulate``).  The
command is the user's own: ``python -m flashpar.cli train --device cuda --nproc 1 --dp 1 --cp 1 --tp 1
...`` as a child (the launcher spawns its one rank), first ``--check`` on a small model (one step of
the mesh model against the single-process model), then ``steps`` steps of a ~0.4B-parameter model
in bf16 on 8192-token packed sequences; the report takes the loss curve, tokens/s, MFU and peak
memory from the run's ``metrics.jsonl`` and ``summary.json``.

In process (the CPU rehearsal): the same flags through ``flashpar.cli.main`` with this process as
rank 0 of a world of 1 on gloo (``RANK`` set, as under torchrun), the group destroyed afterwards.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import time
from pathlib import Path

from flashpar.gpu_check.runner import Outcome, run_child

WORLD_1 = ["--nproc", "1", "--dp", "1", "--cp", "1", "--tp", "1"]
FULL_CHECK = ["--hidden", "256", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "704",
              "--seq-len", "1024"]
FULL_TRAIN = ["--hidden", "2048", "--layers", "8", "--heads", "16", "--kv-heads", "4", "--ffn", "5632",
              "--seq-len", "8192", "--dtype", "bf16", "--steps", "20", "--workers", "1"]
TINY = ["--seq-len", "256", "--max-docs", "40", "--workers", "0"]
TINY_TRAIN = [*TINY, "--steps", "2"]


def argvs(device: str, tiny: bool, work: Path) -> dict[str, list[str]]:
    """The two commands' arguments (after ``flashpar``)."""
    common = ["train", "--device", device, *WORLD_1, "--timeout", "120"]
    return {"check": [*common, "--check", *(TINY if tiny else FULL_CHECK), "--out", str(work / "check")],
            "train": [*common, *(TINY_TRAIN if tiny else FULL_TRAIN), "--out", str(work / "train")]}


def check_rows(output: str) -> list[dict]:
    """``--check``'s ``PASS|FAIL  group  error`` lines."""
    return [{"group": m[2], "passed": m[1] == "PASS", "error": float(m[3])}
            for m in re.finditer(r"^\s+(PASS|FAIL)\s+(\S.*?)\s+(\S+)$", output, re.MULTILINE)]


def train_figures(out: Path) -> dict:
    """Loss per step, tokens/s, MFU and peak memory of the run in ``out`` (empty if it wrote nothing)."""
    figures: dict = {}
    metrics, summary = out / "metrics.jsonl", out / "summary.json"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        figures["losses"] = [r["loss"] for r in rows]
        figures["step_s"] = [r.get("step_s") for r in rows]
    if summary.is_file():
        s = json.loads(summary.read_text())
        figures.update({k: s.get(k) for k in ("steps", "first_loss", "final_loss", "tokens_per_s", "mfu", "peak_mem_mb",
                                              "wall_s", "dtype", "peak_flops_per_rank")})
    return figures


def _in_process(argv: list[str]) -> tuple[int, str]:
    """``flashpar`` with ``argv`` in this process as rank 0 of 1: (exit status, what it printed)."""
    import torch
    import torch.distributed as dist

    from flashpar.cli import main
    from flashpar.dist import free_port

    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    printed, threads = io.StringIO(), torch.get_num_threads()  # the trainer sets --threads for its rank
    try:
        with contextlib.redirect_stdout(printed):
            rc = main(argv)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return rc, printed.getvalue()


def run(part, ctx) -> Outcome:
    t0 = time.perf_counter()
    result: dict = {"commands": {}}
    outputs, status, error = [], "passed", None
    for name, argv in argvs(ctx.device, ctx.tiny, ctx.work).items():
        result["commands"][name] = "flashpar " + " ".join(argv)
        left = part.limit_s - (time.perf_counter() - t0)
        limit = 0.4 * part.limit_s if name == "check" else left  # the check is one small step
        if ctx.in_process:
            rc, output = _in_process(argv)
            timed_out = False
        else:
            got = run_child(f"{part.name} {name}", [ctx.python, "-m", "flashpar.cli", *argv], limit, None,
                            env=ctx.env(), cwd=ctx.root)
            rc, output, timed_out = got.result.get("rc"), got.output, got.status == "timeout"
        outputs.append(f"$ flashpar {' '.join(argv)}\n{output}")
        if name == "check":
            rows = check_rows(output)
            ok = rc == 0 and bool(rows) and all(r["passed"] for r in rows)
            result["check"] = {"rc": rc, "passed": ok, "rows": rows, "timed_out": timed_out}
        else:
            figures = train_figures(Path(argv[argv.index("--out") + 1]))
            losses = figures.get("losses", [])
            want = int(argv[argv.index("--steps") + 1])
            ok = (rc == 0 and len(losses) == want and all(math.isfinite(x) for x in losses)
                  and (want < 3 or losses[-1] < losses[0]))
            result["train"] = {"rc": rc, "passed": ok, "steps_wanted": want, "timed_out": timed_out, **figures}
        if timed_out:
            status, error = "timeout", f"{name}: killed after its {limit:.0f} s limit"
        elif not ok and status == "passed":
            status, error = "failed", f"{name} failed (exit status {rc})"
    return Outcome(part.name, status, time.perf_counter() - t0, part.limit_s, result, "\n".join(outputs), error)
