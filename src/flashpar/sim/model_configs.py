"""The models ``flashpar simulate train`` knows by name, and ``--model`` read as a name or a Hugging Face config.

Shipped (``flashpar/sim/configs/<name>.json``, Hugging Face ``config.json`` files written here from the models'
published architecture numbers; read by the same :meth:`flashpar.models.LlamaConfig.from_hf` as any other):

    name         family   hidden  layers  heads / kv  head dim  FFN     vocabulary  parameters
    llama3-8b    llama    4096    32      32 / 8      128       14336   128256      8.03 B (untied)
    llama3-70b   llama    8192    80      64 / 8      128       28672   128256      70.6 B (untied)
    qwen3-8b     qwen3    4096    36      32 / 8      128       12288   151936      8.2 B (untied, q/k norm)
    qwen3-32b    qwen3    5120    64      64 / 8      128       25600   151936      32.8 B (untied, q/k norm)
    qwen2.5-7b   qwen2    3584    28      28 / 4      128       18944   152064      7.62 B (untied, q/k/v bias)
    mistral-7b   mistral  4096    32      32 / 8      128       14336   32768       7.25 B (v0.3: no window)
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from flashpar.models.config import LlamaConfig, hf_fields

SHIPPED = ("llama3-8b", "llama3-70b", "qwen3-8b", "qwen3-32b", "qwen2.5-7b", "mistral-7b")


def load_model(spec: str) -> LlamaConfig:
    """A shipped name (:data:`SHIPPED`) or the path of a Hugging Face ``config.json`` (or its folder);
    ``ValueError`` (one line) when it is neither or the file is not a Llama config flashpar implements."""
    if spec in SHIPPED:
        text = resources.files("flashpar.sim").joinpath("configs", f"{spec}.json").read_text()
        return LlamaConfig(**hf_fields(json.loads(text)))
    p = Path(spec)
    if not p.exists():
        raise ValueError(f"--model {spec!r}: not a shipped model ({', '.join(SHIPPED)}) nor a config.json path")
    try:
        return LlamaConfig.from_hf(p)
    except (OSError, ValueError) as err:
        raise ValueError(f"--model {spec}: {err}") from None
