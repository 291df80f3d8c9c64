"""``TrainConfig``: the flags are its fields, its values are validated in one place; ``StepMetrics``' line."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from flashpar.models import LlamaConfig
from flashpar.train.config import TrainConfig, add_arguments, from_args
from flashpar.train.metrics import StepMetrics


def _parse(*argv: str) -> TrainConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_args(p.parse_args(list(argv)))


def test_the_flags_default_to_the_dataclass_and_set_every_field():
    assert _parse() == TrainConfig()
    config = _parse("--dp", "2", "--cp", "1", "--seq-len", "128", "--strategy", "per_doc", "--dp-mode", "replicate",
                    "--lr", "0.01", "--max-docs", "7", "--hidden", "96", "--heads", "6", "--kv-heads", "2",
                    "--check", "--resume", "ckpt", "--save-every", "3")
    assert config == TrainConfig(dp=2, cp=1, seq_len=128, strategy="per_doc", dp_mode="replicate", lr=0.01,
                                 max_docs=7, model=LlamaConfig(hidden=96, heads=6, kv_heads=2), check=True,
                                 resume="ckpt", save_every=3)
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
    ({"timeout": 0.0}, "timeout and lr must be positive"),
    ({"max_docs": 0}, "max-docs must be None or >= 1"),
    ({"model": LlamaConfig(heads=6, kv_heads=3, hidden=96)}, "kv heads = 3 is not divisible by tp = 2"),
    ({"model": LlamaConfig(ffn=75)}, "FFN size = 75 is not divisible by tp = 2"),
    ({"seq_len": 7}, r"seq-len 7 is too short for cp = 2 x tp = 2 \(at least 8 tokens\)"),
])
def test_bad_values_are_named_in_one_line(kw, words):
    with pytest.raises(ValueError, match=words) as err:
        TrainConfig(**kw)
    assert "\n" not in str(err.value)


def test_step_metrics_line_has_the_fields_and_the_plan_figures():
    plan = {"est_step_ms": 1.0, "plan_kv_bytes": 10.0, "exposed_comm_ms_est": 0.5}
    m = StepMetrics(step=3, loss=2.5, step_s=0.5, tokens_per_s=100.0, mfu=0.1, kv_bytes=10, planning_ms_dp0=1.5,
                    plan=plan)
    assert m.row() == {"step": 3, "loss": 2.5, "step_s": 0.5, "tokens_per_s": 100.0, "mfu": 0.1, "kv_bytes": 10,
                       "planning_ms_dp0": 1.5, **plan}
    assert m.postfix()["exposed"] == "0.500ms"
