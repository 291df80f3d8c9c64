"""The training runs that the trainer's end-to-end tests and the README-command test share.

A launch of ``flashpar train`` costs about 12 s on 2 cores before its first step (four ranks import
torch and its optimizer), so each run below is made once per test session and every test that needs
its output reads it: ``tests/test_train_cli.py`` (metrics, trace, plot, resume on the same and on other
meshes, ``--check``) and ``tests/test_readme_commands.py`` (the README's training commands).

The runs, in order, in one folder (the later runs resume the first one's checkpoint of step 2)::

    train                4 steps, checkpoints at 2 and 4, trace, plot   (README: train, --save-every, --trace --plot)
    resume-same          from step 2, same mesh (1, 2, 2): steps 3, 4
    resume-ulysses       from step 2 on (1, 2, 2, 1): Ulysses inside cp  (README: --resume ... --ulysses 2 --tp 1)
    resume-per-doc-ring  from step 2 on (2, 2, 1), ZeRO-3, per_doc, ring (README: --dp 2 ... per_doc --mode ring)
    check-hf             --check on the sizes of a Hugging Face config   (README: --check, --hf-config)
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from flashpar.cli import main
from flashpar.train.config import TrainConfig

# every run: a short corpus and sequence, plans made in the rank (no data-loader process to start)
TRAIN = ["--seq-len", "256", "--max-docs", "40", "--workers", "0"]
HF_CONFIG = {"vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 64}
STEP2 = "runs/train/checkpoints/step_2"
RUNS = {  # name -> argv (run in this order, in the session's folder)
    "train": ["train", "--steps", "4", "--save-every", "2", "--trace", "--plot", *TRAIN],
    "resume-same": ["train", "--resume", STEP2, "--steps", "4", "--out", "runs/same", *TRAIN],
    "resume-ulysses": ["train", "--resume", STEP2, "--cp", "2", "--ulysses", "2", "--tp", "1", "--steps", "4",
                       "--out", "runs/ulysses", *TRAIN],
    "resume-per-doc-ring": ["train", "--resume", STEP2, "--dp", "2", "--cp", "2", "--tp", "1", "--strategy", "per_doc",
                            "--mode", "ring", "--steps", "4", "--out", "runs/resumed", *TRAIN],
    "check-hf": ["train", "--check", "--hf-config", "path/to/config.json", "--out", "runs/check", *TRAIN],
}


@dataclass(frozen=True)
class Run:
    """One finished run: its exit status, what it printed, and its ``--out`` folder."""

    rc: int
    stdout: str
    stderr: str
    out: Path

    def losses(self) -> dict[int, float]:
        rows = map(json.loads, (self.out / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["loss"] for r in rows}


def make_runs(root: Path) -> dict[str, Run]:
    """Every run of ``RUNS`` in ``root`` (the working directory while they run: the README's paths are
    relative); stdout and stderr of each go to files there (the launcher's ranks write to real file
    descriptors)."""
    (root / "path" / "to").mkdir(parents=True, exist_ok=True)
    (root / "path" / "to" / "config.json").write_text(json.dumps(HF_CONFIG))
    runs, cwd = {}, os.getcwd()
    os.chdir(root)
    try:
        for name, argv in RUNS.items():
            out_path, err_path = root / f"{name}.stdout", root / f"{name}.stderr"
            with open(out_path, "w") as out, open(err_path, "w") as err, \
                    contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = main(argv)
            out_dir = argv[argv.index("--out") + 1] if "--out" in argv else TrainConfig.out  # the run's --out
            runs[name] = Run(rc, out_path.read_text(), err_path.read_text(), root / out_dir)
    finally:
        os.chdir(cwd)
    return runs
