"""The four parts of ``make gpu-check``, their limits, and how each one runs (see ``flashpar.gpu_check``).

``tests`` and ``train`` run their own commands (pytest, ``flashpar train``) as children; ``attention``
and ``gemm`` run ``python -m flashpar.gpu_check.part NAME`` as a child, which writes its result as JSON.
``Context.in_process`` runs every part in the calling process instead (pytest through ``pytest.main``;
no hard limit): the CPU rehearsal of ``tests/test_gpu_check.py``, where a child's imports would cost
more than the part.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from flashpar.gpu_check.runner import Outcome, run_child

STARTUP_S = 20.0  # of a measuring child's limit kept for importing torch, starting CUDA and writing its result


@dataclass(frozen=True)
class Part:
    name: str
    limit_s: float  # hard: the child is killed past it
    what: str  # one line of the plan printed at the start


PARTS = (
    Part("tests", 90, "pytest -m cuda: the CUDA-only tests (the default flash backend, torch's fused SDPA kernels, "
                      "and varlen FlashAttention-2 vs math, forward and backward; cp.attention on CUDA)"),
    Part("attention", 150, "CP segment-attention TFLOP/s (math, flash, varlen) on 32K-128K-token packs of shipped "
                           "length lists, Llama-8B heads, bf16, forward and backward, against dense SDPA flash "
                           "attention"),
    Part("gemm", 60, "GEMM efficiency of N = 2..8 row pieces written into output slices vs one GEMM, 8B-model "
                     "shapes at TP 2, 4, 8, bf16"),
    Part("train", 150, "flashpar train --device cuda at world size 1 (NCCL): --check, then 20 steps; loss, tokens/s"),
)
NAMES = tuple(p.name for p in PARTS)


@dataclass(frozen=True)
class Context:
    device: str  # "cuda" or "cpu"
    tiny: bool
    work: Path  # scratch folder: the children's results, the trainer's runs
    in_process: bool = False
    python: str = sys.executable

    @property
    def root(self) -> Path:
        """The checkout holding this package (``src/flashpar/gpu_check`` -> the repository)."""
        return Path(__file__).resolve().parents[3]

    def env(self) -> dict:
        """The children's environment: this one, flashpar's ``src`` first on the path, output unbuffered."""
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONUNBUFFERED"] = "1"
        return env


def run_part(part: Part, ctx: Context) -> Outcome:
    """Run one part; whatever happens, an ``Outcome`` (a part's own exception is its ``error``)."""
    from flashpar.gpu_check import cuda_tests, trainer

    try:
        if part.name == "tests":
            return cuda_tests.run(part, ctx)
        if part.name == "train":
            return trainer.run(part, ctx)
        return _measure(part, ctx)
    except Exception as err:  # noqa: BLE001 - recorded; the next part runs
        return Outcome(part.name, "error", 0.0, part.limit_s, {}, "", f"{type(err).__name__}: {err}")


def budget_of(part: Part) -> float:
    """Seconds a measuring child may spend measuring (its limit less the start-up share)."""
    return max(0.5 * part.limit_s, part.limit_s - STARTUP_S)


def _measure(part: Part, ctx: Context) -> Outcome:
    if ctx.in_process:
        from flashpar.gpu_check.part import measure

        t0 = time.perf_counter()
        result = measure(part.name, ctx.device, ctx.tiny, budget_of(part))
        return Outcome(part.name, result["status"], time.perf_counter() - t0, part.limit_s, result, "",
                       result.get("error"))
    result_path = ctx.work / f"{part.name}.json"
    cmd = [ctx.python, "-m", "flashpar.gpu_check.part", part.name, "--device", ctx.device, "--result",
           str(result_path), "--budget-s", str(budget_of(part))] + (["--tiny"] if ctx.tiny else [])
    return run_child(part.name, cmd, part.limit_s, result_path, env=ctx.env(), cwd=ctx.root)
