"""A torchrun worker for ``tests/test_restart.py``: the default group from ``flashpar.mesh.init_world``, one
all-reduce, and in the first attempt rank 1 SIGKILLs itself after it; a restarted attempt all-reduces again and
prints what it got."""

from __future__ import annotations

import datetime
import os
import signal

import torch
import torch.distributed as dist

from flashpar.mesh import init_world

if __name__ == "__main__":
    init_world("gloo", datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    total = torch.ones(1)
    dist.all_reduce(total)
    if attempt == 0 and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(total)
    print(f"attempt {attempt} rank {rank} sum {int(total)}", flush=True)
    dist.destroy_process_group()
