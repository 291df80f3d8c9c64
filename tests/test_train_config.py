"""``TrainConfig``: the flags are its fields, its values are validated in one place; ``StepMetrics``' line."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from flashpar.models import LlamaConfig
from flashpar.train.config import TrainConfig, add_arguments, from_args, ready
from flashpar.train.metrics import StepMetrics


def _parse(*argv: str) -> TrainConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_args(p.parse_args(list(argv)))


def test_the_flags_default_to_the_dataclass_and_set_every_field():
    assert _parse() == TrainConfig()
    config = _parse("--dp", "2", "--cp", "1", "--seq-len", "128", "--strategy", "per_doc", "--dp-mode", "replicate",
                    "--lr", "0.01", "--max-docs", "7", "--hidden", "96", "--heads", "6", "--kv-heads", "2",
                    "--check", "--resume", "ckpt", "--save-every", "3", "--micro-batches", "4", "--warmup", "20",
                    "--lr-min", "0.001", "--weight-decay", "0.05", "--clip", "0.5")
    assert config == TrainConfig(dp=2, cp=1, seq_len=128, strategy="per_doc", dp_mode="replicate", lr=0.01,
                                 max_docs=7, model=LlamaConfig(hidden=96, heads=6, kv_heads=2), check=True,
                                 resume="ckpt", save_every=3, micro_batches=4, warmup=20, lr_min=0.001,
                                 weight_decay=0.05, clip=0.5)
    with pytest.raises(TypeError, match="positional"):
        TrainConfig(1)  # keyword-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.steps = 3


@pytest.mark.parametrize("kw, words", [
    ({"strategy": "diagonal"}, "strategy must be one of contiguous, headtail"),
    ({"mode": "fast"}, "mode must be one of flash, ring"),
    ({"dp_mode": "fsdp"}, "dp-mode must be one of zero3, replicate"),
    ({"device": "tpu"}, "device must be one of cpu, cuda"),
    ({"steps": 0}, "steps must be an integer >= 1, got 0"),
    ({"tp": 1.5}, r"tp must be an integer >= 1, got 1.5"),
    ({"workers": -1}, "workers must be an integer >= 0"),
    ({"timeout": 0.0}, "timeout must be a positive number of seconds, got 0.0"), ({"lr": 0.0}, "lr must be positive"),
    ({"max_docs": 0}, "max-docs must be None or >= 1"),
    ({"model": LlamaConfig(heads=6, kv_heads=3, hidden=96)}, "kv heads = 3 is not divisible by tp = 2"),
    ({"model": LlamaConfig(ffn=75)}, "FFN size = 75 is not divisible by tp = 2"),
    ({"seq_len": 7}, r"seq-len 7 is too short for cp = 2 x ulysses = 1 x tp = 2 \(at least 8 tokens\)"),
    ({"ulysses": 0}, "ulysses must be an integer >= 1, got 0"),
    ({"ulysses": 2}, "ulysses = 2 and tp = 2 both > 1 is not supported: Ulysses and tensor parallelism both split "
                     r"the attention heads \(compose --ulysses with --dp and --cp, --tp 1\)"),
    ({"ulysses": 2, "tp": 1, "mode": "ring"}, "mode ring does not apply to the Ulysses all-to-alls"),
    ({"ulysses": 3, "tp": 1}, "ulysses = 3: heads = 4 is not divisible by the sequence-parallel size 3"),
    ({"ulysses": 4, "tp": 1, "model": LlamaConfig(heads=6, kv_heads=3, hidden=96)},
     "ulysses = 4: heads = 6 is not divisible"),
    ({"ulysses": 4, "tp": 1, "model": LlamaConfig(heads=12, kv_heads=3, hidden=96)},
     r"ulysses = 4: kv_heads = 3 < 4 ranks must divide 4"),
    ({"ulysses": 2, "tp": 1, "cp": 4, "seq_len": 15}, r"cp = 4 x ulysses = 2 x tp = 1 \(at least 16 tokens\)"),
    ({"dtype": "fp8"}, "dtype must be one of fp32, bf16, got 'fp8'"),
    ({"checkpoint_activations": 1}, "checkpoint-activations must be True or False, got 1"),
])
def test_bad_values_are_named_in_one_line(kw, words):
    with pytest.raises(ValueError, match=words) as err:
        TrainConfig(**kw)
    assert "\n" not in str(err.value)


def test_ulysses_meshes_are_accepted_and_count_in_the_world_size():
    """``--ulysses U --tp 1`` with dp and cp: the world is dp x cp x ulysses x tp; fewer kv heads than U
    (replicated) and heads divisible by 3 at U = 3 are fine."""
    assert _parse("--ulysses", "2", "--tp", "1").world_size == 4
    assert TrainConfig(dp=2, cp=2, ulysses=2, tp=1).world_size == 8
    assert TrainConfig(cp=1, ulysses=4, tp=1, model=LlamaConfig(heads=4, kv_heads=2)).world_size == 4
    assert TrainConfig(cp=1, ulysses=3, tp=1, model=LlamaConfig(hidden=48, heads=6, kv_heads=3)).world_size == 3
    with pytest.raises(ValueError, match=r"mesh dp x cp x ulysses x tp = 1 x 2 x 2 x 1 = 4 does not match the 2 "):
        ready(TrainConfig(ulysses=2, tp=1), 2)


def test_step_metrics_line_has_the_fields_and_the_plan_figures():
    plan = {"est_step_ms": 1.0, "plan_kv_bytes": 10.0, "exposed_comm_ms_est": 0.5}
    m = StepMetrics(step=3, loss=2.5, step_s=0.5, tokens_per_s=100.0, model_flops_per_s=2e9, mfu=0.1, kv_bytes=10,
                    planning_ms_dp0=1.5, plan=plan, lr=1e-3, grad_norm=0.75)
    assert m.row() == {"step": 3, "loss": 2.5, "step_s": 0.5, "tokens_per_s": 100.0, "model_flops_per_s": 2e9,
                       "mfu": 0.1, "kv_bytes": 10, "planning_ms_dp0": 1.5, "lr": 1e-3, "grad_norm": 0.75, **plan}
    assert m.postfix()["exposed"] == "0.500ms" and m.postfix()["mfu"] == "10.0%"
    cpu = dataclasses.replace(m, mfu=None)  # no vendor peak on CPU: the model's FLOP/s, no MFU
    assert "mfu" not in cpu.postfix() and cpu.postfix()["gflop_s"] == "2.0" and cpu.row()["mfu"] is None


def test_a_checkpoint_without_the_data_keys_resumes_and_a_bad_meta_is_one_line(tmp_path):
    """meta.json of a checkpoint written before the data / tokenizer / held-out keys and the rope-scaling and
    max-positions model fields existed: it was made with their defaults, so a run with the defaults resumes
    it; a run that changes one of them is refused, naming it; a meta.json that is not one is one line."""
    import json

    from flashpar.train import checkpoint

    config = TrainConfig(max_docs=40, seq_len=256)
    old_model = {k: v for k, v in config.model.to_dict().items() if k not in ("rope_scaling", "max_positions")}
    (tmp_path / "meta.json").write_text(json.dumps({"step": 2, "sequences": 2, "mesh": [1, 2, 1, 2],
                                                    "model": old_model, "seq_len": 256, "max_docs": 40, "seed": 0}))
    assert checkpoint.read_meta(tmp_path, config)["step"] == 2
    with pytest.raises(ValueError, match="other settings: --eval-every / --eval-docs 0 there, 8 here"):
        checkpoint.read_meta(tmp_path, dataclasses.replace(config, eval_every=5))
    for bad in ("[1, 2]", "{\"step\": \"two\", \"sequences\": 2}", "not json"):
        (tmp_path / "meta.json").write_text(bad)
        with pytest.raises(ValueError, match="is not a flashpar meta.json") as err:
            checkpoint.read_meta(tmp_path, config)
        assert "\n" not in str(err.value)


def test_every_field_is_in_one_help_group_and_help_shows_the_groups():
    """``GROUPS`` holds every ``TrainConfig`` field exactly once, but the ``ParallelOptions`` settings that are no
    flag (the library's: ``gather_vocab``), and ``flashpar train --help`` lists its flags under those titles, in
    that order."""
    import argparse
    import dataclasses

    from flashpar.options import OPTION_FIELDS
    from flashpar.train.config import GROUPS, TrainConfig, add_arguments

    named = [n for _, names in GROUPS for n in names]
    library = [n for n, f in OPTION_FIELDS.items() if f.metadata["group"] is None]
    assert library == ["gather_vocab", "attention_backend"]
    assert sorted(named + library) == sorted(f.name for f in dataclasses.fields(TrainConfig))
    assert len(named) == len(set(named))
    p = argparse.ArgumentParser()
    add_arguments(p)
    text = p.format_help()
    at = [text.index(f"\n{title}:") for title, _ in GROUPS]
    assert at == sorted(at)
    assert text.index("--zero-collective", at[1]) < at[2] and text.index("--clip", at[3]) < at[4]


def _probe_many(out: str, times: int) -> None:
    from flashpar.train.config import writable

    for _ in range(times):
        writable(Path(out))


def test_ranks_checking_one_output_folder_at_once_do_not_trip_each_other(tmp_path):
    """torchrun's ranks all run the output-folder check at the same moment: one rank's probe removed under
    another (a shared probe name) ended a 4-rank job with "not writable: No such file or directory"."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_probe_many, args=(str(tmp_path / "out"), 400)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert not list((tmp_path / "out").iterdir())
