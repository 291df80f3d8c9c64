"""Model definitions: a small Llama-style decoder (``LlamaConfig``, ``Llama``) and Hugging Face folders in and
out (``load_hf``, ``save_hf``).

The sizes (``LlamaConfig``, ``RopeScaling``) import without torch; the model and the folder readers and writers
are imported on first use (``__getattr__``), so a command's ``--help`` that shows the sizes' defaults does not
wait for torch.
"""

import importlib

from flashpar.models.config import LlamaConfig, RopeScaling

_TORCH_NAMES = {"Llama": "llama", "document_positions": "llama", "next_token_loss": "llama",
                "load_hf": "hf", "save_hf": "hf"}  # name -> its module


def __getattr__(name: str):
    if name not in _TORCH_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_TORCH_NAMES[name]}"), name)


__all__ = ["Llama", "LlamaConfig", "RopeScaling", "document_positions", "load_hf", "next_token_loss", "save_hf"]
