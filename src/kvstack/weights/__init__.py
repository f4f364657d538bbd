"""Weight loaders: GGUF and safetensors -> one Checkpoint in Hugging Face names and layout."""

from kvstack.weights.checkpoint import Checkpoint
from kvstack.weights.load import load_checkpoint
from kvstack.weights.resolve import EMBEDDED_MODEL, GEMMA3_MODEL, resolve_model

__all__ = ["EMBEDDED_MODEL", "GEMMA3_MODEL", "Checkpoint", "load_checkpoint", "resolve_model"]
