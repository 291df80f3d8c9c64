"""``python -m flashpar.gpu_check`` / ``make gpu-check``: run the parts, write the report (``flashpar.gpu_check``)."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flashpar.gpu_check import report
from flashpar.gpu_check.cuda_tests import VERDICTS
from flashpar.gpu_check.parts import NAMES, PARTS, Context, run_part
from flashpar.gpu_check.runner import Outcome


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cuda: the GPU check; cpu: a rehearsal of its code paths (auto: cuda when available)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (seconds on a CPU)")
    p.add_argument("--dry-run", action="store_true", help="--device cpu --tiny: rehearse every part on the CPU")
    p.add_argument("--only", choices=NAMES, action="append", help="run only this part (repeatable)")
    p.add_argument("--out", default=None, help="report folder (default: $OUT when set, else runs/gpu-check)")
    p.add_argument("--in-process", action="store_true",
                   help="run every part in this process (no hard limits; for tests)")


def device_of(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False); "
                         "`python -m flashpar.gpu_check --dry-run` rehearses the check on the CPU")
    return choice


def setup(device: str, tiny: bool, root: Path) -> dict:
    import torch

    name = torch.cuda.get_device_name(0) if device == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    schemas = {}
    for op in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
               "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
               "_flash_attention_forward", "_flash_attention_backward"):
        packet = getattr(torch.ops.aten, op, None)
        schemas[op] = str(packet.default._schema) if packet is not None else "missing"
    return {"device": device, "device_name": name, "tiny": tiny, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "commit": commit,
            "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "op_schemas": schemas}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashpar.gpu_check", description=(__doc__ or "").strip())
    add_arguments(p)
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.tiny = "cpu", True
    try:
        device = device_of(args.device)
    except ValueError as err:
        print(f"gpu-check: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or os.environ.get("OUT") or "runs/gpu-check")
    parts = [q for q in PARTS if not args.only or q.name in args.only]
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        ctx = Context(device, args.tiny, Path(work), in_process=args.in_process)
        info = setup(device, args.tiny, ctx.root)
        print(f"gpu-check on {info['device_name']} (torch {info['torch']}, {'tiny' if args.tiny else 'full'} sizes): "
              f"{len(parts)} parts, each a child process with a hard limit, {sum(q.limit_s for q in parts):.0f} s "
              f"at most; the report goes to {out}/gpu-check.md and .json", flush=True)
        for i, q in enumerate(parts, 1):
            print(f"  {i}. {q.name:<9} ({q.limit_s:.0f} s) {q.what}", flush=True)
        print("  One GPU cannot host two NCCL ranks: multi-rank figures come from `flashpar simulate`.", flush=True)
        outcomes: list[Outcome] = []
        t0 = time.perf_counter()
        for i, q in enumerate(parts, 1):
            print(f"[{i}/{len(parts)}] {q.name} ...", flush=True)
            got = run_part(q, ctx)
            outcomes.append(got)
            print(f"[{i}/{len(parts)}] {q.name}: {got.status} in {got.wall_s:.1f} s"
                  + (f" ({got.error})" if got.error else ""), flush=True)
        info["wall_s"] = time.perf_counter() - t0
        info["limit_s"] = float(sum(q.limit_s for q in parts))
        tests = next((o for o in outcomes if o.name == "tests"), None)
        absent = {"passed": None, "tests": 0, "detail": "the tests part did not run"}
        rep = {"setup": info, "notes": list(report.NOTES),
               **{name: (tests.result.get(name) if tests is not None else None) or absent for name in VERDICTS},
               "parts": [o.row() for o in outcomes]}
        js, md = report.write(rep, out)
        log = out / "gpu-check.log"
        log.write_text("\n".join(f"===== {o.name}: {o.status} =====\n{o.output}" for o in outcomes))
    bad = [o.name for o in outcomes if o.status not in ("passed", "skipped")]
    said = {True: "passed", False: "FAILED", None: "not run"}
    print(f"gpu-check: {'all parts passed' if not bad else 'NOT passed: ' + ', '.join(bad)}; "
          + "; ".join(f"{name} {said[rep[name]['passed']]}" for name in VERDICTS)
          + f"; report: {md} (and {js.name}, {log.name})", flush=True)
    return 0 if not bad else 1
