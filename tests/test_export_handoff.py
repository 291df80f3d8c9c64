"""``flashpar export``'s files beside the weights (``flashpar.train.handoff``): tokenizer, generation config, modes.

The whole export (a trained checkpoint to a folder transformers loads, tokenizer and generate included) is
``tests/test_train_cli.py``'s own-model test; here each piece, on a small tokenizer trained in the test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flashpar.train import handoff

EOD = "<|end_of_text|>"


@pytest.fixture
def tokenizer_folder(tmp_path) -> Path:
    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20, tk.trainers.BpeTrainer(
        vocab_size=280, special_tokens=[EOD], show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_tokenizer_files_are_copied_and_a_config_names_the_end_token(tokenizer_folder, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tokenizer_folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOD}))
    written = handoff.copy_tokenizer(tokenizer_folder, out)
    assert written == ["tokenizer.json", "special_tokens_map.json", "tokenizer_config.json"]
    assert (out / "tokenizer.json").read_bytes() == (tokenizer_folder / "tokenizer.json").read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == EOD
    # a source folder's own tokenizer_config.json is copied as it is
    (tokenizer_folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOD, "model_max_length": 99}))
    assert "tokenizer_config.json" in handoff.copy_tokenizer(tokenizer_folder / "tokenizer.json", out)
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 99
    assert handoff.copy_tokenizer(None, out) == []
    with pytest.raises(ValueError, match="no tokenizer.json there"):
        handoff.copy_tokenizer(tmp_path / "nothing", out)


@pytest.mark.parametrize("source, eod, want", [
    (None, 7, {"eos_token_id": 7}),  # from the run's tokenizer
    ({"bos_token_id": 1, "eos_token_id": 2}, 7, {"bos_token_id": 1, "eos_token_id": [2, 7],
                                                  "_from_model_config": False}),  # the source's, and the run's eod
    ({"eos_token_id": [5, 7]}, 7, {"eos_token_id": [5, 7]}),  # already there: unchanged
    ({"eos_token_id": 3, "temperature": 0.6}, None, {"eos_token_id": 3, "temperature": 0.6}),  # bytes: as it is
])
def test_generation_config(tmp_path, source, eod, want):
    init = tmp_path / "init"
    init.mkdir()
    if source is not None:
        (init / "generation_config.json").write_text(json.dumps(source))
    out = tmp_path / "out"
    out.mkdir()
    assert handoff.write_generation_config(init, out, eod) == ["generation_config.json"]
    assert json.loads((out / "generation_config.json").read_text()) == want


def test_no_generation_config_without_source_or_end_token(tmp_path):
    assert handoff.write_generation_config(None, tmp_path, None) == []
    assert not (tmp_path / "generation_config.json").exists()


def test_ordinary_modes(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"x")
    os.chmod(path, 0o600)  # what a writer through a private temporary file leaves
    handoff.ordinary_modes(tmp_path, ["model.safetensors"])
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_sources_of_an_older_checkpoint_are_empty(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"step": 1}))
    assert handoff.sources_of(tmp_path) == {} and handoff.sources_of(tmp_path / "missing") == {}
