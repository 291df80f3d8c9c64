"""Model definitions: a small Llama-style decoder (``LlamaConfig``, ``Llama``) and Hugging Face folders in and
out (``load_hf``, ``save_hf``)."""

from flashpar.models.config import LlamaConfig, RopeScaling
from flashpar.models.hf import load_hf, save_hf
from flashpar.models.llama import Llama, document_positions, next_token_loss

__all__ = ["Llama", "LlamaConfig", "RopeScaling", "document_positions", "load_hf", "next_token_loss", "save_hf"]
