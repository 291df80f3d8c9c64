"""``ParallelOptions`` (``flashpar.options``): one value for how a model runs on its mesh, validated once, inherited by
``TrainConfig`` (its fields are the trainer's flags), resolved at set-up, refused unresolved by the model."""

from __future__ import annotations

import dataclasses

import pytest

from flashpar.options import OPTION_FIELDS, ParallelOptions, flag, of
from flashpar.train.config import TrainConfig


@pytest.mark.parametrize(("kw", "words"), [
    ({"mode": "fast"}, "mode must be one of flash, ring, slice, none, auto, got 'fast'"),
    ({"dp_mode": "fsdp"}, "dp-mode must be one of zero3, replicate"),
    ({"dtype": "fp16"}, "dtype must be one of fp32, bf16, got 'fp16'"),
    ({"zero_schedule": "sometimes"}, "zero-schedule must be one of auto, prefetch, fused or one of prefetch, fused"),
    ({"zero_schedule": ("prefetch", "auto")}, "zero-schedule must be"),
    ({"zero_collective": "tree"}, "zero-collective must be one of auto, ring, doubling"),
    ({"prefetch": -1}, "prefetch must be an integer >= 0, got -1"),
    ({"regather": "yes"}, "regather must be True or False, got 'yes'"),
    ({"timeout": 0}, "timeout must be a positive number of seconds, got 0"),
    ({"attention_backend": "cudnn"}, "attention-backend must be one of auto, flash, math, varlen"),
])
def test_bad_options_are_named_in_one_line(kw, words):
    with pytest.raises(ValueError, match=words) as err:
        ParallelOptions(**kw)
    assert "\n" not in str(err.value)


def test_the_trainer_config_is_its_options_and_its_own_settings():
    """Every option is a ``TrainConfig`` field under the same name; ``options()`` is them alone; the trainer's
    defaults leave ZeRO-3's choices to set-up (auto), the library's are the plain schedule and the backend's ring."""
    config = TrainConfig(mode="auto", regather=True, dtype="bf16", zero_schedule=["fused", "prefetch"])
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(OPTION_FIELDS) <= names
    opts = config.options()
    assert opts == of(config) and isinstance(opts, ParallelOptions) and type(opts) is ParallelOptions
    assert (opts.mode, opts.regather, opts.save_gathered, opts.dtype_bytes) == ("auto", True, False, 2)
    assert opts.zero_schedule == ("fused", "prefetch")  # a list given: held as a tuple (hashable, comparable)
    assert (TrainConfig().zero_schedule, TrainConfig().zero_collective) == ("auto", "auto")
    assert (ParallelOptions().zero_schedule, ParallelOptions().zero_collective) == ("prefetch", "ring")
    assert not TrainConfig().options().resolved and ParallelOptions().resolved
    text = opts.describe()
    assert "mode auto" in text and "dtype bf16" in text and "regather on" in text and "\n" not in text
    assert "zero-schedule fused,prefetch" in text and "attention-backend auto" in text
    assert all(f"{flag(name)} " in text for name in OPTION_FIELDS)  # every setting, a new one with no edit
    assert ParallelOptions(**{**opts.to_dict()}) == opts  # the JSON form reads back (checkpoints, summaries)


def test_the_model_refuses_choices_left_to_set_up():
    from flashpar.models.parallel import ParallelLlama

    with pytest.raises(ValueError, match="'auto' is chosen before the model is built"):
        ParallelLlama(None, None, ParallelOptions(zero_collective="auto"))
    with pytest.raises(TypeError):
        ParallelLlama(None, None, no_such_setting=1)
