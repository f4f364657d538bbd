"""Loading a checkpoint by name: the embedded model, a .gguf file or a Hugging Face folder."""

from __future__ import annotations

from kvstack.errors import ModelLoadError
from kvstack.weights.checkpoint import Checkpoint
from kvstack.weights.gguf_loader import load_gguf
from kvstack.weights.resolve import resolve_model
from kvstack.weights.safetensors_loader import load_safetensors


def load_checkpoint(model: str) -> Checkpoint:
    """Load `smollm2-135m`, `gemma3-270m`, a .gguf file, or a Hugging Face folder
    (config.json + safetensors)."""
    path = resolve_model(model)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path)
    if path.is_dir():
        return load_safetensors(path)
    raise ModelLoadError(
        f"{path} is neither a .gguf file nor a folder; give a GGUF file or a Hugging Face folder"
    )
