"""``flashpar generate --init-from`` a transformers-built Qwen3 (q/k norm, head_dim apart from hidden / heads,
biases, a tied vocabulary of 61 rows that tp 2 pads to 62) on a tp 2 mesh: its greedy tokens equal transformers'
``generate``."""

from __future__ import annotations

import json

import pytest
import torch

from families_workers import randomize_features
from flashpar.cli import main


def test_greedy_generate_of_qwen3_on_tp_2_equals_transformers(tmp_path, capfd):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=12, attention_bias=True,
                                   max_position_embeddings=128, tie_word_embeddings=True, initializer_range=0.1,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    randomize_features(model, 1)
    model.save_pretrained(tmp_path / "qwen3")
    assert_greedy_equals(model, tmp_path / "qwen3", tmp_path, capfd, [[3, 14, 15, 9, 26, 5, 35], list(range(1, 22)),
                                                                     [60]], ["--tp", "2"], 8)


@pytest.mark.parametrize(("family", "mesh"), [("mistral", ["--cp", "2"]), ("qwen2", ["--tp", "2", "--cp", "2"])])
def test_greedy_generate_with_sliding_windows_equals_transformers(tmp_path, capfd, family, mesh):
    """Windows of 5 tokens, shorter than the prompts and than what decoding adds: the prefill's windowed attention
    over cp ranks (a 21-token prompt split between them), then each decode step's window over the sharded cache
    (keys older than the window dropped, on whichever rank holds them).  Mistral: every layer; Qwen2: the second of
    two (max_window_layers 1)."""
    transformers = pytest.importorskip("transformers")
    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
             "initializer_range": 0.1, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    if family == "mistral":
        cfg, cls = transformers.MistralConfig(**sizes, sliding_window=5), transformers.MistralForCausalLM
    else:
        cfg = transformers.Qwen2Config(**sizes, use_sliding_window=True, sliding_window=5, max_window_layers=1)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model.save_pretrained(tmp_path / "m")
    assert_greedy_equals(model, tmp_path / "m", tmp_path, capfd, [[3, 14, 15, 9, 26, 5, 35], list(range(1, 22)),
                                                                  [60, 2]], mesh, 12)


def assert_greedy_equals(model, folder, tmp_path, capfd, prompts, mesh, new: int) -> None:
    """``flashpar generate --init-from folder`` on ``mesh``: each prompt's ``new`` greedy tokens equal
    transformers' ``generate`` of ``model`` (the folder's)."""
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"tokens": p}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--no-progress", "--init-from", str(folder), "--prompts", str(tmp_path / "p.jsonl"),
                 *mesh, "--max-new-tokens", str(new), "--out", str(out)])
    err = capfd.readouterr().err
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row, p in zip(rows, prompts, strict=True):
        with torch.no_grad():
            want = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
        assert row["tokens"] == want.tolist(), (row, want)
