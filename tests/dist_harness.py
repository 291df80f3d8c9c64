"""Run a function on N gloo ranks in their own processes and collect each rank's return value.

The processes fork from a server that has imported torch (``flashpar.ranks``), so a rank starts in
milliseconds; one spawn per world size still runs many cases (fewer process groups to set up);
results come back through a queue, and a rank's exception comes back with its traceback.
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist

from flashpar import ranks
from flashpar.dist import free_port


def _entry(rank: int, world_size: int, port: int, fn, args, results, inherit) -> None:
    inherit.apply()  # the parent's environment and stdout / stderr (flashpar.ranks: forked from a server)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # N ranks share 2 cores
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, timeout: float = 240.0) -> list:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each in its own process."""
    ctx = ranks.context()  # forked from a server that has imported torch: no start-up import per rank
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results, ranks.Inherit()), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors = []
    import time

    deadline = time.monotonic() + timeout
    while len(out) + len(errors) < world_size:
        if time.monotonic() > deadline:
            break
        if results.empty():
            if not any(p.is_alive() for p in procs) and results.empty():
                break
            time.sleep(0.02)
            continue
        rank, status, value = results.get()
        if status == "ok":
            out[rank] = value
        else:
            errors.append(f"rank {rank}:\n{value}")
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    if len(out) < world_size:
        raise RuntimeError(f"only ranks {sorted(out)} of {world_size} reported within {timeout}s")
    return [out[r] for r in range(world_size)]


def _many(rank: int, world_size: int, calls) -> dict:
    return {name: fn(rank, world_size, *args) for name, fn, *args in calls}


class SpawnCache:
    """One spawn per world size for a whole test module (process start-up is most of a small case).

    ``calls(n)`` lists the ``(name, fn, *args)`` that the module's tests need at world size ``n``; the
    first test that asks for ``n`` runs them all, in order, on the same ranks (put cases that leave the
    group unusable last), and ``cache(n)[name]`` is ``[fn(rank, n, *args) for rank in range(n)]``."""

    def __init__(self, calls, *, timeout: float = 240.0) -> None:
        self.calls, self.timeout, self.results = calls, timeout, {}

    def __call__(self, n: int) -> dict[str, list]:
        if n not in self.results:
            calls = self.calls(n)
            try:
                per_rank = run_ranks(n, _many, calls, timeout=self.timeout)
                self.results[n] = {name: [out[name] for out in per_rank] for name, *_ in calls}
            except RuntimeError as err:  # a failed spawn fails every test that reads it, without a rerun each
                self.results[n] = err
        if isinstance(self.results[n], RuntimeError):
            raise self.results[n]
        return self.results[n]
