"""The Llama-style reference decoder and its config."""

from __future__ import annotations

import json

import pytest
import torch

from flashpar.models import Llama, LlamaConfig, document_positions, next_token_loss


def test_parameter_count_and_positions():
    for tie in (True, False):
        cfg = LlamaConfig(tie_embeddings=tie)
        assert cfg.params == sum(p.numel() for p in Llama(cfg).parameters())
    assert document_positions([3, 1, 2]).tolist() == [0, 1, 2, 0, 0, 1]


def test_documents_are_independent_and_causal():
    """A document's logits are the same packed with others or alone (document mask, per-document
    positions), and a token never sees a later one."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig()).double()
    a, b, c = (torch.randint(0, 256, (n,)) for n in (9, 14, 5))
    packed = model(torch.cat([a, b, c]), [9, 14, 5])
    alone = model(b, [14])
    torch.testing.assert_close(packed[9:23], alone, rtol=0, atol=1e-10)  # float64: order of sums only
    changed = torch.cat([a, b, c]).clone()
    changed[20] = (changed[20] + 1) % 256
    after = model(changed, [9, 14, 5])
    torch.testing.assert_close(after[:20], packed[:20], rtol=0, atol=1e-10)
    assert not torch.allclose(after[20:23], packed[20:23])


def test_loss_ignores_targets_across_documents():
    logits = torch.randn(6, 256)
    labels = torch.tensor([1, 2, -100, 4, 5, -100])
    full = torch.nn.functional.cross_entropy(logits[[0, 1, 3, 4]], labels[[0, 1, 3, 4]])
    torch.testing.assert_close(next_token_loss(logits, labels), full)
    torch.testing.assert_close(next_token_loss(logits, labels, count=8), full * 4 / 8)


def test_hugging_face_config(tmp_path):
    hf = {"vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
          "num_key_value_heads": 8, "intermediate_size": 14336, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": False, "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = LlamaConfig.from_hf(tmp_path)
    assert (cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.ffn, cfg.head_dim) == (4096, 32, 32, 8, 14336, 128)
    assert 8.0e9 < cfg.params < 8.1e9  # Llama-3-8B: 8.03B parameters
    del hf["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="hidden_size"):
        LlamaConfig.from_hf(tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="no config.json at"):
        LlamaConfig.from_hf(tmp_path / "missing")


@pytest.mark.parametrize("kw, words", [({"heads": 4, "kv_heads": 3}, "multiple of kv_heads"),
                                       ({"hidden": 0}, "positive"), ({"head_dim": 7}, "even head_dim")])
def test_bad_config_is_named(kw, words):
    with pytest.raises(ValueError, match=words):
        LlamaConfig(**kw)
