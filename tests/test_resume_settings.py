"""A resume continues with its checkpoint's settings: the flags given again change them, the rest come from
meta.json's ``settings``; what must not change is refused by flag."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from flashpar.cli import parser_for
from flashpar.models import LlamaConfig
from flashpar.train.config import TrainConfig, from_args
from flashpar.train.resume_settings import INVOCATION, difference_line, merged, newest, saved, settings

SAVED = TrainConfig(nproc=2, dp=2, cp=1, tp=1, seq_len=256, steps=40, lr=1e-3, warmup=3, micro_batches=2,
                    max_docs=40, seed=7, save_every=10, eval_every=5, eval_docs=3, dtype="bf16",
                    checkpoint_activations=True, model=LlamaConfig(hidden=32, layers=1, ffn=64), out="runs/x")


def _checkpoint(root, step: int, config: TrainConfig | None, marker: bool = True):
    folder = root / f"step_{step}"
    folder.mkdir(parents=True)
    meta = {"step": step, "sequences": step, **({"settings": settings(config)} if config else {})}
    (folder / "meta.json").write_text(json.dumps(meta))
    if marker:
        (folder / "flashpar.json").write_text("{}")
    return folder


def _parsed(*argv):
    parser, _ = parser_for(["train"])
    return from_args(parser.parse_args(["train", *argv]))


def test_settings_hold_every_field_and_come_back_equal(tmp_path):
    values = settings(SAVED)
    assert set(values) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert values["out"] == str(Path("runs/x").resolve())
    back = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(json.dumps(values)).items()}
    back["model"] = LlamaConfig(**back["model"])
    assert dataclasses.replace(TrainConfig(**back), out="runs/x") == SAVED


def test_a_resume_without_flags_is_the_saved_run(tmp_path, capsys):
    _checkpoint(tmp_path, 10, SAVED)
    config = _parsed("--resume", str(tmp_path))
    for name in (f.name for f in dataclasses.fields(TrainConfig)):
        if name not in INVOCATION and name != "out":
            assert getattr(config, name) == getattr(SAVED, name), name
    assert config.nproc == 2  # the mesh's size, not a saved process count
    assert "the run's settings from its checkpoint" in capsys.readouterr().err


def test_flags_given_again_win_and_the_mesh_may_change(tmp_path):
    _checkpoint(tmp_path, 10, SAVED)
    config = _parsed("--resume", str(tmp_path), "--steps", "80", "--dp", "1", "--cp", "2", "--lr", "3e-3")
    assert (config.steps, config.dp, config.cp, config.lr, config.nproc) == (80, 1, 2, 3e-3, 2)
    assert (config.warmup, config.micro_batches, config.dtype, config.seed) == (3, 2, "bf16", 7)
    # a flag given at its default value is still given: --checkpoint-activations off cannot be said, but --seed 0 can
    assert _parsed("--resume", str(tmp_path), "--seed", "0").seed == 0
    # a model size flag given: the model is the flags', whole (the kept check then refuses it, by flag)
    assert _parsed("--resume", str(tmp_path), "--hidden", "64").model == LlamaConfig(hidden=64)


def test_the_newest_marked_checkpoint_is_read_and_old_checkpoints_keep_the_flags(tmp_path):
    _checkpoint(tmp_path, 10, dataclasses.replace(SAVED, steps=30))
    _checkpoint(tmp_path, 20, SAVED)
    _checkpoint(tmp_path, 30, dataclasses.replace(SAVED, steps=99), marker=False)  # an unfinished save
    assert newest(tmp_path).name == "step_20" and saved(str(tmp_path))["steps"] == 40
    assert saved(str(tmp_path / "step_10"))["steps"] == 30
    old = tmp_path / "old"
    _checkpoint(old, 5, None)  # saved before checkpoints held settings: the flags given, as they are
    assert saved(str(old)) is None and _parsed("--resume", str(old)).steps == TrainConfig.steps
    assert saved(str(tmp_path / "missing")) is None


def test_merged_takes_only_what_was_not_given():
    out, taken = merged({"lr": 1.0, "steps": 5, "resume": "a", "data": None}, {"steps"},
                        {"lr": 2.0, "steps": 9, "resume": "b", "nproc": 3, "data": ["/d"]})
    assert out == {"lr": 2.0, "steps": 5, "resume": "a", "data": ("/d",)} and sorted(taken) == ["data", "lr"]


def test_a_kept_difference_is_one_line_by_flag():
    line = difference_line("ck", ["seq_len", "held_out"], {"seq_len": 256, "held_out": 8},
                           {"seq_len": 128, "held_out": 0})
    assert line == ("checkpoint ck was made with other settings: --seq-len 256 there, 128 here; "
                    "--eval-every / --eval-docs 8 there, 0 here (leave those flags out to continue with the "
                    "checkpoint's)")
    assert "held_out" not in line


@pytest.mark.parametrize("flag", ["--plot", "--trace", "--check"])
def test_switches_are_noted_as_given(flag):
    parser, _ = parser_for(["train"])
    args = parser.parse_args(["train", flag])
    assert args.flags_given == {flag[2:]}


def test_resume_auto_on_an_out_without_checkpoints_is_a_fresh_start(tmp_path, capsys):
    """``--resume auto``, the command line of a job's first launch and of every restart: nothing saved yet under
    ``--out`` (or only an unfinished save) is a fresh start with the flags given, said in one line."""
    out = tmp_path / "run"
    config = _parsed("--resume", "auto", "--out", str(out), "--steps", "7")
    assert config.resume is None and config.steps == 7
    assert f"--resume auto: no checkpoint in {out / 'checkpoints'}: a fresh start" in capsys.readouterr().err
    _checkpoint(out / "checkpoints", 10, SAVED, marker=False)  # a save killed before its marker
    assert _parsed("--resume", "auto", "--out", str(out)).resume is None


def test_resume_auto_continues_the_runs_own_newest_checkpoint_with_its_settings(tmp_path, capsys):
    """With a marked checkpoint under ``<--out>/checkpoints``: that folder (its newest step, checked when the run
    starts, a broken newest one skipped as ``--resume`` skips it), the settings the checkpoint records for every
    flag not given, and the flags given winning."""
    out = tmp_path / "run"
    _checkpoint(out / "checkpoints", 10, SAVED)
    _checkpoint(out / "checkpoints", 20, SAVED)
    config = _parsed("--resume", "auto", "--out", str(out), "--steps", "80")
    assert config.resume == str(out / "checkpoints") and config.out == str(out)
    assert (config.steps, config.seq_len, config.seed, config.dtype, config.lr) == (80, 256, 7, "bf16", 1e-3)
    assert "the run's settings from its checkpoint" in capsys.readouterr().err


def test_resume_auto_skips_a_broken_newest_checkpoint_and_refuses_a_conflicting_flag(train_runs, tmp_path, capsys):
    """A restart's ``--resume auto`` on a real run's checkpoints (the shared ``train`` run: step_2 and step_4): a byte
    flipped in step_4's largest file makes it skip step_4 with one line and resume step_2; a kept setting given
    otherwise (``--seq-len``) is one line naming the flag."""
    import shutil

    from flashpar.train.config import ready

    out = tmp_path / "run"
    shutil.copytree(train_runs["train"].out / "checkpoints", out / "checkpoints")
    files = [p for p in (out / "checkpoints" / "step_4").rglob("*") if p.is_file()]
    largest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    largest.write_bytes(bytes(data))
    config = ready(_parsed("--resume", "auto", "--out", str(out)), 4)
    assert Path(config.resume) == out / "checkpoints" / "step_2"
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and "step_4" in err, err
    with pytest.raises(ValueError, match=r"--seq-len 256 there, 128 here"):
        ready(_parsed("--resume", "auto", "--out", str(out), "--seq-len", "128"), 4)
