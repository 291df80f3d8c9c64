"""Every command the README and the docs pages show in a ```bash block runs (shortened: few steps, one round,
loopback, small packs), so a documented command cannot break silently.

``RUNS`` is the table: each README command maps to the run that exercises it.  Commands that a run
shares (``flashpar train`` with ``--save-every``, ``--trace --plot``) are grouped into one invocation, and
the shortening flags come after the README's, so they override its values (``--steps``, ``--link-rate``);
the training runs are the session's shared ones (``tests/train_runs.py``), which the trainer's own
end-to-end tests read too.
A run must carry every option of each README command it stands for (checked), so grouping cannot drop
one.  Commands that cannot run here are listed in ``SKIPPED`` with the reason; a README command in
neither table fails the test.
"""

from __future__ import annotations

import json
import platform
import re
import shlex
from pathlib import Path

import pytest

from flashpar.cli import main
from train_runs import RUNS as TRAIN_RUNS

README = Path(__file__).resolve().parents[1] / "README.md"
PAGES = [README, *sorted((README.parent / "docs").glob("*.md"))]  # the front page and the docs site's pages
OVERLAP = ["--link-rate", "none", "--rounds", "1", "--shapes", "small-M", "--modes", "none,ring:1,flash:2,auto",
           "--seq-local", "16", "--width", "32"]
CP = ["--nproc", "2", "--link-rate", "none", "--tokens", "1024", "--packs", "1", "--rounds", "1", "--heads", "2",
      "--kv-heads", "1", "--head-dim", "16"]

# run name -> argv: the training runs are the session's shared ones (tests/train_runs.py: the resume runs
# need the first run's checkpoints), the others run here in this order
TRAINING = ("train", "resume-same", "resume-ulysses", "resume-per-doc-ring", "resume-compiled", "check-hf", "own-model",
            "export")
RUNS = {
    **{name: TRAIN_RUNS[name] for name in TRAINING},
    "plan-wlbllm": ["plan", "--lengths", "wlbllm", "--cp", "8", "--tokens", "131072", "--packs", "2"],
    "plan-file": ["plan", "--lengths", "my_lengths.txt", "--cp", "4"],
    "bench-plan": ["bench", "plan", "--packs", "1", "--lists", "sotu,long-context"],
    # three of the five ops (one per schedule family: all-gather, ZeRO-3, all-to-all; the README's --ops is
    # overridden), 2 ranks (the README's 4-rank runs differ only in --nproc's value)
    "bench-overlap": ["bench", "overlap", "--nproc", "2", *OVERLAP, "--ops", "ag,fsdp,qkv", "--json",
                      "bench-overlap.json"],
    "bench-cp": ["bench", "cp", "--lengths", "prolong", *CP, "--json", "bench-cp.json"],
    # every option of the README's bench train commands, on 2 ranks (Ulysses 2; the torch peer: cp 2)
    "bench-train": ["bench", "train", "--dp", "1", "--cp", "1", "--ulysses", "2", "--tp", "1", "--hidden", "32",
                    "--ffn", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--seq-len", "128",
                    "--link-rate", "none", "--rounds", "1", "--steps", "1", "--warmup", "1",
                    "--json", "bench-train.json"],
    # simulate train (pure Python; the README's sizes shortened), then simulate check of the bench-train run's JSON
    "simulate-train": ["simulate", "train", "--model", "llama3-8b", "--gpus", "64", "--tp", "8", "--seq", "8192"],
    "simulate-search": ["simulate", "train", "--model", "llama3-8b", "--gpus", "16", "--seq", "8192", "--search",
                        "--configs", "flashpar", "--lengths", "my_lengths.txt"],
    "simulate-config": ["simulate", "train", "--model", "config.json", "--dp", "2", "--cp", "4", "--tp", "8", "--seq",
                        "32768", "--lengths", "my_lengths.txt", "--json", "simulate-train.json"],
    "simulate-check": ["simulate", "check", "bench-train.json"],
    # simulate cp (every option of the README's commands, a tiny grid) and simulate check of the README's bench cp
    "simulate-cp": ["simulate", "cp", "--grid", "8:16K", "--lengths", "sotu,long-context", "--packs", "1",
                    "--json", "sim-cp.json"],
    "simulate-check-cp": ["simulate", "check", str(README.parent / "docs/benchmarks/cp.json")],
    # simulate: pure Python, the README's own arguments (a bench overlap JSON from the repository)
    "simulate-overlap": ["simulate", "overlap", "--block", "mlp", "--tp", "4", "--batch", "32", "--seq", "4096",
                         "--hidden", "4096", "--hardware", "h100-nvlink", "--paper", "--json", "out.json"],
    "simulate-check-overlap": ["simulate", "check", str(README.parent / "docs" / "benchmarks" / "overlap.json")],
}
COMMANDS = {  # README command -> the run that exercises it
    "flashpar train": "train",
    "flashpar train --dp 2 --cp 2 --tp 1 --strategy per_doc --mode ring --steps 100 --seq-len 4096":
        "resume-per-doc-ring",
    "flashpar train --check": "check-hf",
    "flashpar train --compile": "resume-compiled",
    "flashpar train --save-every 100": "train",
    "flashpar train --resume runs/train/checkpoints": "resume-same",
    "flashpar train --resume runs/train/checkpoints --steps 800 --ulysses 2 --tp 1": "resume-ulysses",
    "flashpar train --trace --plot": "train",
    "flashpar train --hf-config path/to/config.json": "check-hf",
    "flashpar train --init-from path/to/llama --tokenizer path/to/llama --data my_docs --micro-batches 8 --warmup 100 "
    "--lr 3e-4 --lr-min 3e-5 --clip 1.0 --dtype bf16 --checkpoint-activations --eval-every 100 --save-every 500 "
    "--steps 2000 --out runs/mine": "own-model",
    "flashpar export runs/mine/checkpoints --hf runs/mine/hf": "export",
    "flashpar plan --lengths wlbllm --cp 8 --tokens 131072": "plan-wlbllm",
    "flashpar plan --lengths my_lengths.txt --cp 4": "plan-file",
    "flashpar bench plan": "bench-plan",
    "flashpar bench overlap --nproc 2 --link-rate 1gbit --rounds 15 --shapes hidden": "bench-overlap",
    "flashpar bench overlap --nproc 4 --link-rate 300mbit --rounds 9 --shapes hidden": "bench-overlap",
    "flashpar bench overlap --nproc 2 --link-rate 1gbit --rounds 5 --shapes comm-heavy,small-M --ops fsdp,qkv,out":
        "bench-overlap",
    "flashpar bench overlap --nproc 4 --link-rate 300mbit --rounds 3 --shapes comm-heavy,small-M --ops fsdp,qkv,out":
        "bench-overlap",
    "flashpar bench cp --nproc 4 --link-rate 300mbit --packs 2 --rounds 5 --json docs/benchmarks/cp.json": "bench-cp",
    "flashpar bench cp --nproc 4 --link-rate 300mbit --lengths prolong": "bench-cp",
    "flashpar bench train": "bench-train",
    "flashpar bench train --link-rate 800mbit": "bench-train",
    "flashpar bench train --link-rate 1gbit": "bench-train",
    "flashpar bench train --cp 2 --ulysses 2 --tp 1 --hidden 256 --ffn 704 --seq-len 2048 --link-rate 500mbit":
        "bench-train",
    "flashpar bench train --cp 2 --ulysses 2 --tp 1": "bench-train",
    "flashpar bench train --dp 2 --cp 1 --tp 2 --rounds 3": "bench-train",
    "flashpar bench train --hidden 256 --ffn 704 --seq-len 2048 --link-rate 500mbit": "bench-train",
    "flashpar bench train --dp 2 --cp 1 --tp 2 --hidden 256 --ffn 704 --seq-len 2048 --link-rate 500mbit":
        "bench-train",
    "flashpar simulate train --model llama3-8b --gpus 64 --tp 8 --seq 8192": "simulate-train",
    "flashpar simulate train --model llama3-70b --gpus 512 --seq 131072 --search": "simulate-search",
    "flashpar simulate train --model path/to/config.json --dp 2 --cp 4 --tp 8 --seq 32768 --json out.json":
        "simulate-config",
    "flashpar simulate check docs/benchmarks/train-default.json": "simulate-check",
    "flashpar simulate cp": "simulate-cp",
    "flashpar simulate cp --grid 8:128K,32:512K,128:2M --json sim-cp.json": "simulate-cp",
    "flashpar simulate cp --grid 1024:8M --lengths wlbllm,prolong,spamassassin,long-context --packs 1": "simulate-cp",
    "flashpar simulate check docs/benchmarks/cp.json": "simulate-check-cp",
    "flashpar simulate overlap --block mlp --tp 4 --batch 32 --seq 4096 --hidden 4096 --hardware h100-nvlink "
    "--paper --json out.json": "simulate-overlap",
    "flashpar simulate check docs/benchmarks/overlap.json": "simulate-check-overlap",
}
SKIPPED = {
    "make run": "sets up .venv and trains 400 steps (minutes); its `flashpar train` is run here shortened",
    "make test": "is this test suite (ruff + pytest, what CI runs)",
    "make setup": "creates .venv: every test runs in it",
    "flashpar train --tp 2 --cp 3": "6 ranks; the process count that follows the mesh is tested in tests/test_cli.py",
    "make bench": "runs the benchmarks at full size (about 6 minutes); their commands are run here shortened",
    "make gpu-check": "needs a CUDA GPU; its CPU rehearsal (--dry-run) runs in tests/test_gpu_check.py",
    "python -m flashpar.gpu_check --dry-run": "runs in tests/test_gpu_check.py (in process: --in-process)",
    "flashpar bench drill --reference --json runs/drill.json": "needs root and a minute; runs in tests/test_drill.py "
                                                               "with 8 steps",
}
OVERRIDDEN = {"--ops"}  # options whose value a run may change (it runs other ops than the README line)


def readme_commands() -> list[str]:
    """Each command line of the ```bash blocks of the README and the docs pages, comments stripped."""
    lines = []
    for block in (b for page in PAGES for b in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)):
        for line in block.splitlines():
            command = line.split(" #", 1)[0].strip()
            if command and not command.startswith("#"):
                lines.append(command)
    return lines


def options(argv: list[str]) -> set[str]:
    return {a for a in argv if a.startswith("--")}


def test_every_readme_command_is_run_or_skipped_with_a_reason():
    shown = readme_commands()
    unknown = [c for c in shown if c not in COMMANDS and c not in SKIPPED]
    assert not unknown, f"README commands with no run in tests/test_readme_commands.py: {unknown}"
    stale = (set(COMMANDS) | set(SKIPPED)) - set(shown)
    assert not stale, f"table entries the README no longer shows: {stale}"
    for command, run in COMMANDS.items():
        words = shlex.split(command)[1:]
        subcommand = [w for w in words if not w.startswith("-")][: 2 if words[0] in ("bench", "simulate") else 1]
        assert RUNS[run][: len(subcommand)] == subcommand, (command, run)
        missing = options(words) - options(RUNS[run]) - OVERRIDDEN
        assert not missing, f"run {run!r} drops {missing} of README command {command!r}"


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_lengths.txt").write_text("\n".join(map(str, [900, 30, 4000, 120, 77, 2500, 60, 3100] * 4)))
    from importlib import resources  # a Hugging Face config.json for `simulate train --model`: the shipped 8B one

    shipped = resources.files("flashpar.sim").joinpath("configs", "llama3-8b.json")
    (tmp_path / "config.json").write_text(shipped.read_text())
    return tmp_path


def test_training_commands_run(train_runs):
    for name in TRAINING:
        assert train_runs[name].rc == 0, (name, train_runs[name].stderr[-3000:])
    train, resumed, check = train_runs["train"], train_runs["resume-per-doc-ring"], train_runs["check-hf"]
    assert "trained 4 steps" in train.stdout and "mesh dp=2 cp=2 tp=1" in resumed.stdout
    assert "mesh dp=1 cp=2 ulysses=2 tp=1" in train_runs["resume-ulysses"].stdout
    assert check.stdout.strip().endswith("PASS") and "FAIL" not in check.stdout
    assert (train.out / "train.png").is_file() and list(train.out.glob("trace_rank*.json"))
    assert list((train.out / "checkpoints").glob("step_*")) and (resumed.out / "summary.json").is_file()


def test_planning_and_benchmark_commands_run(in_tmp, capsys):
    for name in ("plan-wlbllm", "plan-file", "bench-plan", "bench-overlap", "bench-cp", "bench-train", "simulate-train",
                 "simulate-search", "simulate-config", "simulate-check"):
        assert main(RUNS[name]) == 0, name
    out = capsys.readouterr().out
    assert "== wlbllm: 2 pack(s) of 131072 tokens" in out and "== my_lengths.txt: one pack of" in out
    assert "MagiAttention anchor" in out and "Planning time" in out
    assert "running N=2" in out and "ovl/ideal" in out and "auto>" in out and "prolong lengths / 16" in out
    overlap = json.loads((in_tmp / "bench-overlap.json").read_text())[0]  # the end-to-end check of bench overlap
    entries = {e["shape"]["name"]: e for e in overlap["shapes"]}
    assert overlap["world_size"] == 2 and {"ag-small-M", "fsdp-small-M", "qkv-small-M"} <= set(entries)
    modes = {name: [m["mode"] for m in e["modes"]] for name, e in entries.items()}
    assert modes["fsdp-small-M"] == ["none", "ring", "flash", "auto"]
    assert modes["qkv-small-M"] == ["none", "flash", "auto"], "ring does not apply to an all-to-all"
    row = entries["ag-small-M"]["modes"][2]
    assert row["mode"] == "flash" and {"compute", "comm", "overlapped", "ideal", "bound"} <= set(row["forward"])
    assert overlap["hardware"]["comm_cpu_s_per_byte"] == overlap["comm_cpu"]["s_per_byte"] >= 0  # contention
    if platform.machine() in ("x86_64", "AMD64"):  # DAZ / FTZ: compute-only runs read unfilled buffers at full speed
        assert overlap["denormals_flushed"] is True
    rounds = entries["ag-small-M"]["rounds"]  # each round's slowest-rank time, per kind (simulate check's spread)
    assert {k: len(v) for k, v in row["backward"]["samples"].items()} == dict.fromkeys(
        ("overlapped", "compute", "comm"), rounds)
    assert "first-step losses agree" in out and "dp 1 x cp 1 x ulysses 2 x tp 1" in out
    report = json.loads((in_tmp / "bench-train.json").read_text())
    assert report["setup"]["losses_agree"] is True and report["setup"]["ulysses"] == 2
    assert [c["name"] for c in report["configs"]] == ["flashpar", "baseline", "torch"]
    assert "fastest flashpar layout:" in out and "bench train: bench-train.json (predicted" in out
    rows = json.loads((in_tmp / "simulate-train.json").read_text())["rows"]
    assert [(r["config"], r["layout"]) for r in rows] == [(c, "dp2 cp4 u1 tp8") for c in ("flashpar", "baseline",
                                                                                          "torch", "torch_async_tp")]


def test_simulate_cp_commands_run(in_tmp, capsys):
    for name in ("simulate-cp", "simulate-check-cp"):
        assert main(RUNS[name]) == 0, name
    out = capsys.readouterr().out
    assert "simulated, h100-ib" in out and "flashcp vs megatron_dynamic" in out and "bench cp:" in out


def test_simulate_overlap_commands_run(in_tmp, capsys):
    for name in ("simulate-overlap", "simulate-check-overlap"):
        assert main(RUNS[name]) == 0, name
    out = capsys.readouterr().out
    assert "simulated, h100-nvlink preset" in out and "43.8 ms -> 0.1 ms" in out and "ratios within 15%" in out
