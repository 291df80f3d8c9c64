"""A flashpar model as a Hugging Face folder and back: transformers loads it whole and computes the same logits.

Run: python docs/examples/hf_roundtrip.py   (needs transformers: pip install 'flashpar[dev]')
"""

import tempfile

import torch
from transformers import LlamaForCausalLM

from flashpar.models import Llama, LlamaConfig, load_hf, save_hf

cfg = LlamaConfig(vocab_size=128, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, tie_embeddings=False)
torch.manual_seed(0)
model = Llama(cfg)
doc = torch.randint(0, cfg.vocab_size, (16,))
with tempfile.TemporaryDirectory() as folder:
    save_hf(model, folder)  # config.json (transformers 5 style) + model.safetensors
    hf, info = LlamaForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    back = load_hf(folder)  # the same Llama again (each tensor as saved)
with torch.no_grad():
    theirs = hf(doc[None], use_cache=False).logits[0]
    ours, again = model(doc, [16]), back(doc, [16])
assert torch.equal(ours, again)
difference = float((ours - theirs).abs().max() / theirs.abs().max())
print(f"relative difference of the logits, flashpar vs transformers: {difference:.1e}")
