"""Model definitions: a small Llama-style decoder (``LlamaConfig``, ``Llama``)."""

from flashpar.models.config import LlamaConfig
from flashpar.models.llama import Llama, document_positions, next_token_loss

__all__ = ["Llama", "LlamaConfig", "document_positions", "next_token_loss"]
