"""Weight loaders: GGUF and safetensors -> one Checkpoint in Hugging Face names and layout."""

from kvstack.weights.checkpoint import Checkpoint
from kvstack.weights.load import load_checkpoint
from kvstack.weights.resolve import EMBEDDED_MODEL, GEMMA3_MODEL, is_gguf_model, resolve_model

__all__ = ["EMBEDDED_MODEL", "GEMMA3_MODEL", "Checkpoint", "is_gguf_model", "load_checkpoint",
           "resolve_model"]
