"""A ``flashpar train`` launcher for the launcher-death drills (``tests/test_launcher_death.py``), run as a script.

    python tests/lifeline_workers.py OUT WHEN [small]

launches the 4-rank default mesh (tp=2, cp=2) with one data-loader worker per rank, a checkpoint every step,
and a hook that, on rank 0, writes ``OUT/.reached`` and then holds the job (the other ranks wait for rank 0
in the step's collectives) so that the test can record the process tree and SIGKILL this launcher at a known
point: ``WHEN`` is ``run`` (rank 0 held before step 3) or ``save`` (rank 0 held inside the save of step 2,
after its files are written, before the folder is published as ``step_2``).
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

HOLD_S = 60.0  # far longer than the test waits: the job is only ever ended by the launcher's death
STEPS, SAVE_EVERY = 6, 1
SETTINGS = {"seq_len": 128, "max_docs": 60, "workers": 1, "timeout": 60.0}


def hold_before(step: int, at: int, marker: str) -> None:
    """``Hooks.before_step``: rank 0 says it reached step ``at`` and holds there."""
    import torch.distributed as dist

    if step == at and dist.get_rank() == 0:
        Path(marker).write_text(str(step))
        time.sleep(HOLD_S)


def hold_in_save(step: int, at: int, marker: str) -> None:
    """``Hooks.before_step``: from step ``at`` on rank 0, publishing a checkpoint folder says so and holds."""
    import torch.distributed as dist

    from flashpar.train import atomic

    if step != at or dist.get_rank() != 0:
        return
    publish = atomic.publish

    def held(partial, target):
        Path(marker).write_text(str(target))
        time.sleep(HOLD_S)
        publish(partial, target)

    atomic.publish = held


def config(out: str, **changes):
    from flashpar.train.config import TrainConfig

    return TrainConfig(**{"steps": STEPS, "save_every": SAVE_EVERY, "out": out, **SETTINGS, **changes})


def main(out: str, when: str, small: str = "") -> int:
    """``small`` ("small"): 2 ranks (cp=2, tp=1) without data-loader workers, for the drills that need fewer
    processes."""
    from flashpar.train.loop import Hooks
    from flashpar.train.run import launch
    from lifeline_workers import hold_before, hold_in_save  # by module name: the ranks import it (tests/ on the path)

    marker = str(Path(out) / ".reached")
    hook = hold_before if when == "run" else hold_in_save
    at = 3 if when == "run" else 2
    sizes = {"nproc": 2, "tp": 1, "workers": 0} if small else {}
    return launch(config(out, **sizes), hooks=Hooks(before_step=functools.partial(hook, at=at, marker=marker)))


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
