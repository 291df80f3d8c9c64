"""How a benchmark command runs its ranks: one worker process per rank behind the emulated links, a report back.

    flashpar bench X ...  ->  run_workers("flashpar.bench.X", N, config, rate)
                                 N x  python -m flashpar.bench.X --worker CONFIG   (behind links of ``rate``)
                                 rank 0 writes its JSON report to CONFIG["out"]  ->  returned here

The parent validates its arguments before anything is launched; each worker reads only ``config``.  A worker
ends when its parent does, however the parent ends (``flashpar.lifeline``: the parent-death signal and a pipe),
and the emulated links' namespaces of a parent killed with SIGKILL are removed by the next benchmark that
builds links (``flashpar.bench.netlink``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def run_workers(module: str, world_size: int, config: dict, rate: str | None, *, timeout: float) -> dict:
    """Run ``python -m module --worker CONFIG`` on ``world_size`` ranks (on loopback where ``rate`` is None)
    and return the report rank 0 wrote to ``CONFIG["out"]`` (a temporary file made here)."""
    from flashpar.bench.netlink import launch_on_links  # the link emulation, only when a benchmark runs

    with tempfile.TemporaryDirectory(prefix="flashpar-bench-") as tmp:
        out = os.path.join(tmp, "report.json")
        config = {**config, "out": out, "link_rate": rate or "loopback"}
        argv = [sys.executable, "-m", module, "--worker", json.dumps(config)]
        launch_on_links(world_size, argv, rate, timeout=timeout)
        with open(out) as f:
            return json.load(f)


def save_json(path: str | None, report) -> None:
    """``--json PATH``: the report as JSON (nothing without a path)."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {path}")


def module_main(prog: str, add_arguments, run, worker) -> None:
    """``python -m flashpar.bench.X``: a worker rank (``--worker CONFIG``) or the command itself."""
    import argparse

    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        from flashpar.lifeline import watch_from_env

        watch_from_env()  # this worker ends when the benchmark that started it ends, however it ends
        worker(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(prog=prog)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
