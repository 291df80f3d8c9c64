"""``flashpar generate --init-from`` a transformers-built Qwen3 (q/k norm, head_dim apart from hidden / heads,
biases, a tied vocabulary of 61 rows that tp 2 pads to 62) on a tp 2 mesh: its greedy tokens equal transformers'
``generate``."""

from __future__ import annotations

import json

import pytest
import torch

from flashpar.cli import main


def test_greedy_generate_of_qwen3_on_tp_2_equals_transformers(tmp_path, capfd):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=12, attention_bias=True,
                                   max_position_embeddings=128, tie_word_embeddings=True, initializer_range=0.1,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif n.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(tmp_path / "qwen3")
    prompts = [[3, 14, 15, 9, 26, 5, 35], list(range(1, 22)), [60]]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"tokens": p}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--no-progress", "--init-from", str(tmp_path / "qwen3"), "--prompts",
                 str(tmp_path / "p.jsonl"), "--tp", "2", "--max-new-tokens", "8", "--out", str(out)])
    err = capfd.readouterr().err
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row, p in zip(rows, prompts, strict=True):
        with torch.no_grad():
            want = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
        assert row["tokens"] == want.tolist(), (row, want)


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
    prompts = [[3, 14, 15, 9, 26, 5, 35], list(range(1, 22)), [60, 2]]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"tokens": p}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--no-progress", "--init-from", str(tmp_path / "m"), "--prompts",
                 str(tmp_path / "p.jsonl"), *mesh, "--max-new-tokens", "12", "--out", str(out)])
    err = capfd.readouterr().err
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row, p in zip(rows, prompts, strict=True):
        with torch.no_grad():
            want = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
        assert row["tokens"] == want.tolist(), (row, want)
