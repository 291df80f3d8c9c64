"""The families against transformers: tiny random models built with transformers' own classes (Qwen2, Qwen3, Mistral,
Llama tied with biases, YaRN and linear rope), read by ``load_hf``, give transformers' logits on packed documents;
``save_hf`` writes a folder transformers loads as the same class, with no missing or unexpected keys and the same
logits."""

from __future__ import annotations

import pytest
import torch

from families_workers import randomize_features
from flashpar.models import LlamaConfig, load_hf, save_hf
from flashpar.models.families import FAMILIES

DOCS = [17, 1, 40, 9]  # a packed sequence; transformers sees each document alone
# fp32 against fp32: the same ops in another order, and transformers' fp32 rope frequencies against our float64
# ones (angle error p f 6e-8 < 1e-5 at these positions); measured <= 1e-6.  A missing bias or q/k norm, a rope
# frequency or YaRN's scale wrong moves the logits by more than 1e-3 (checked below for each feature).
RTOL = 1e-5
SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-6}
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
# name -> (transformers config class, its model class, config fields beyond SIZES)
MODELS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_parameters": ROPE}),
    "qwen2-linear": ("Qwen2Config", "Qwen2ForCausalLM",
                     {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0},
                      "tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"rope_parameters": ROPE, "head_dim": 12}),
    "qwen3-bias-tied": ("Qwen3Config", "Qwen3ForCausalLM",
                        {"rope_parameters": ROPE, "head_dim": 16, "attention_bias": True, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"rope_parameters": ROPE, "sliding_window": None}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"rope_parameters": ROPE, "sliding_window": 128}),
    # windows shorter than three of the four documents: every layer (Mistral); the second of two layers (Qwen2)
    "mistral-w6": ("MistralConfig", "MistralForCausalLM", {"rope_parameters": ROPE, "sliding_window": 6}),
    "qwen2-sliding": ("Qwen2Config", "Qwen2ForCausalLM",
                      {"rope_parameters": ROPE, "use_sliding_window": True, "sliding_window": 7,
                       "max_window_layers": 1}),
    "llama-tied-bias": ("LlamaConfig", "LlamaForCausalLM",
                        {"rope_parameters": ROPE, "tie_word_embeddings": True, "attention_bias": True,
                         "mlp_bias": True}),
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": YARN}),
    "qwen3-yarn": ("Qwen3Config", "Qwen3ForCausalLM",
                   {"rope_parameters": {**YARN, "beta_fast": 16.0, "mscale": 1.5, "mscale_all_dim": 1.0},
                    "head_dim": 8}),
}


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def build(transformers, name: str, path, seed: int = 0):
    """A random transformers model of ``MODELS[name]`` saved at ``path``; every parameter random (norms around 1,
    biases around 0, std 0.1 weights) so that each feature shows in the logits."""
    config_cls, model_cls, extra = MODELS[name]
    cfg = getattr(transformers, config_cls)(**SIZES, **extra, initializer_range=0.1)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    randomize_features(model, seed + 1)
    model.save_pretrained(path)
    return model


def documents(vocab: int = 64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in DOCS]


def hf_logits(model, docs) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(d[None], use_cache=False).logits[0] for d in docs])


def ours(model, docs) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.cat(docs), [len(d) for d in docs])


@pytest.mark.parametrize("name", list(MODELS))
def test_family_logits_on_packed_documents_equal_transformers(transformers, tmp_path, name):
    hf = build(transformers, name, tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    cfg = model.cfg
    assert cfg.family == hf.config.model_type and FAMILIES[cfg.family].architecture == type(hf).__name__
    head_dim = getattr(hf.config, "head_dim", None) or SIZES["hidden_size"] // SIZES["num_attention_heads"]
    assert cfg.head_dim == head_dim and (model.head is None) == hf.config.tie_word_embeddings
    docs = documents()
    want = hf_logits(hf, docs)
    assert rel(ours(model, docs), want) <= RTOL
    # the test can fail: without the family's features (biases zeroed, q/k norms at one) or without YaRN's scale
    # the logits move by far more than the tolerance
    if any(0 < w < max(DOCS) for w in cfg.windows):  # the band shows: without it the logits move
        import dataclasses

        from flashpar.models import Llama

        unbanded = Llama(dataclasses.replace(cfg, windows=()))
        unbanded.load_state_dict(model.state_dict())
        assert rel(ours(unbanded, docs), want) > 1e-3
    features = [n for n, _ in model.named_parameters() if n.endswith(".bias") or "q_norm" in n or "k_norm" in n]
    if features:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in features:
                    p.copy_(torch.zeros_like(p) if n.endswith(".bias") else torch.ones_like(p))
        assert rel(ours(model, docs), want) > 1e-3


@pytest.mark.parametrize("name", ["qwen2", "qwen3-bias-tied", "mistral-window", "llama-tied-bias", "qwen3-yarn",
                                  "mistral-w6", "qwen2-sliding"])
def test_export_loads_in_transformers_as_the_same_class_with_the_same_logits(transformers, tmp_path, name):
    hf = build(transformers, name, tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    save_hf(model, tmp_path / "out")
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(back) is type(hf) and back.config.model_type == hf.config.model_type
    assert getattr(back.config, "layer_types", None) == getattr(hf.config, "layer_types", None)
    assert back.config.sliding_window == hf.config.sliding_window if name.startswith("mistral") else True
    docs = documents()
    assert rel(hf_logits(back.eval(), docs), hf_logits(hf, docs)) <= RTOL
    assert LlamaConfig.from_hf(tmp_path / "out") == model.cfg


def test_qwen_sliding_layers_are_recorded_per_layer(transformers, tmp_path):
    config_cls, model_cls, extra = MODELS["qwen2"]
    cfg = transformers.Qwen2Config(**{**SIZES, "num_hidden_layers": 3}, **extra, use_sliding_window=True,
                                   sliding_window=16, max_window_layers=1)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    ours_cfg = LlamaConfig.from_hf(tmp_path)
    assert ours_cfg.windows == (0, 16, 16)  # the first max_window_layers layers attend to the whole document
