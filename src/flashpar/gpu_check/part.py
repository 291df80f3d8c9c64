"""``python -m flashpar.gpu_check.part NAME``: one measuring part (``attention`` or ``gemm``) in this process,
its result written as JSON to ``--result`` (the parent's ``runner`` reads it; a crash leaves none)."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

MEASURES = ("attention", "gemm")


def measure(name: str, device: str, tiny: bool, budget_s: float, partial=None) -> dict:
    """The result of part ``name``: ``{"status": "passed" | "failed", ...}``; ``partial(result)`` is called with
    the rows so far after each row (a part killed at its limit keeps them).  On the CPU with one torch thread
    (as one CPU rank runs; tiny kernels on an OpenMP team of a shared machine spend their time waiting)."""
    import torch

    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        return _measure(name, device, tiny, budget_s, partial)
    finally:
        torch.set_num_threads(threads)


def _measure(name: str, device: str, tiny: bool, budget_s: float, partial) -> dict:
    if name == "attention":
        from flashpar.gpu_check import attention_rate

        return attention_rate.run(device, tiny, budget_s, partial)
    if name == "gemm":
        from flashpar.gpu_check import gemm_split

        return gemm_split.run(device, tiny, budget_s, partial)
    raise ValueError(f"unknown measuring part {name!r}; expected one of {', '.join(MEASURES)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashpar.gpu_check.part")
    p.add_argument("name", choices=MEASURES)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--budget-s", type=float, default=60.0)
    p.add_argument("--result", required=True)
    args = p.parse_args(argv)
    out = Path(args.result)

    def partial(result: dict) -> None:  # written whole, then renamed: the parent never reads half a file
        out.with_suffix(".part").write_text(json.dumps({**result, "status": "partial"}, default=str))
        out.with_suffix(".part").replace(out)

    try:
        result = measure(args.name, args.device, args.tiny, args.budget_s, partial)
    except Exception as err:  # noqa: BLE001 - the parent records it with the traceback in the output tail
        traceback.print_exc()
        result = {"status": "error", "error": f"{type(err).__name__}: {str(err).strip()[:500]}"}
    out.write_text(json.dumps(result, default=str))
    return 0 if result["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
