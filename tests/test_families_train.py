"""``flashpar train --init-from`` a transformers-built Qwen3 (q/k norm, head_dim apart from hidden / heads, biases, a
vocabulary of 259 byte-level rows that tp 2 pads to 260) on a 2-rank mesh: a few steps run, and ``--check`` (the
mesh step against the single-process model, ``flashpar.models.step_check``) passes."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import torch

from flashpar.cli import main

TRAIN = ["--seq-len", "128", "--max-docs", "16", "--workers", "0", "--tp", "2"]


def _train(args, where=None) -> tuple[int, str, str]:
    """``flashpar train args`` (in folder ``where``: the runs' relative paths); exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    if where is not None:
        os.chdir(where)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["train", *args])
    finally:
        os.chdir(cwd)
    return code, out.getvalue(), err.getvalue()


def test_train_and_check_a_qwen3_on_tp_2(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=12, attention_bias=True,
                                   max_position_embeddings=256, initializer_range=0.1,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "qwen3")
    code, out, err = _train(["--init-from", "qwen3", "--steps", "2", "--save-every", "1", "--out", "run", *TRAIN],
                            tmp_path)
    assert code == 0, out + err[-3000:]
    code, out, err = _train(["--init-from", "qwen3", "--check", "--out", "check", *TRAIN], tmp_path)
    assert code == 0, out + err[-3000:]
    assert "PASS  q/k/v bias" in out and "PASS  q norm" in out and out.strip().endswith("PASS"), out
    # bf16 with activations recomputed, against the fp32 single-process model within the bf16 bound
    code, out, err = _train(["--init-from", "qwen3", "--check", "--dtype", "bf16", "--checkpoint-activations",
                             "--out", "check16", *TRAIN], tmp_path)
    assert code == 0 and out.strip().endswith("PASS"), out + err[-3000:]
    # step 1's checkpoint resumed on another mesh (cp 2 instead of tp 2): step 2's loss as the straight run's
    code, out, err = _train(["--resume", "run/checkpoints/step_1", "--tp", "1", "--cp", "2", "--out", "resumed"],
                            tmp_path)
    assert code == 0, out + err[-3000:]
    losses = [[json.loads(r)["loss"] for r in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
              for d in ("run", "resumed")]
    assert losses[1] == pytest.approx(losses[0][1:], rel=1e-5)  # fp32, other reduction orders
    # the trained run exported: transformers loads it as a Qwen3 with no missing or unexpected keys
    assert main(["export", str(tmp_path / "run" / "checkpoints"), "--hf", str(tmp_path / "hf")]) == 0
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert type(back).__name__ == "Qwen3ForCausalLM" and not info["missing_keys"] and not info["unexpected_keys"]


def test_check_a_mistral_with_a_sliding_window_on_cp_2(tmp_path):
    """A window of 16 tokens in 128-token sequences of byte documents (most longer than it), split over 2 cp
    ranks: the windowed K/V exchange and band kernels, forward and backward, against the single-process model."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MistralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     sliding_window=16, initializer_range=0.1,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    transformers.MistralForCausalLM(cfg).save_pretrained(tmp_path / "mistral")
    code, out, err = _train(["--init-from", "mistral", "--check", "--out", "check", "--seq-len", "128",
                             "--max-docs", "16", "--workers", "0", "--cp", "2", "--tp", "1"], tmp_path)
    assert code == 0, out + err[-3000:]
    assert out.strip().endswith("PASS"), out


@pytest.mark.parametrize(("family", "mesh"), [("qwen2", ["--tp", "2"]), ("llama", ["--cp", "2", "--tp", "1"])])
def test_check_passes_for_the_other_families(tmp_path, family, mesh):
    """Qwen2's q/k/v biases on tp 2; a tied Llama with attention and MLP biases on cp 2: ``--check`` passes."""
    transformers = pytest.importorskip("transformers")
    sizes = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
             "initializer_range": 0.1, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    if family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes, tie_word_embeddings=True,
                                                                       attention_bias=True, mlp_bias=True))
    model.save_pretrained(tmp_path / family)
    code, out, err = _train(["--init-from", family, "--check", "--out", "check", "--seq-len", "128",
                             "--max-docs", "16", "--workers", "0", *mesh], tmp_path)
    assert code == 0, out + err[-3000:]
    assert "PASS  q/k/v bias" in out and out.strip().endswith("PASS"), out
