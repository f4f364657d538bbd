"""Loading a checkpoint by name: the embedded model, a .gguf file or a Hugging Face folder."""

from __future__ import annotations

from kvstack.errors import InvalidRequestError, ModelLoadError
from kvstack.weights.checkpoint import Checkpoint
from kvstack.weights.gguf_loader import load_gguf
from kvstack.weights.resolve import resolve_model
from kvstack.weights.safetensors_loader import load_safetensors


def load_checkpoint(model: str, quantization: str | None = None) -> Checkpoint:
    """Load `smollm2-135m`, `gemma3-270m`, a .gguf file, or a Hugging Face folder
    (config.json + safetensors).

    quantization="gguf" keeps a GGUF file's quantized linear weights as blocks
    (`Checkpoint.blocks`); other models refuse it. Other values load as without it (int8 is
    applied by the model)."""
    path = resolve_model(model)
    is_gguf = path.is_file() and path.suffix == ".gguf"
    if quantization == "gguf" and not is_gguf:
        raise InvalidRequestError(
            f"quantization='gguf' runs a GGUF file's own quantized weights and {model} is not "
            "a .gguf file; give a GGUF file, or use quantization='int8' or none"
        )
    if is_gguf:
        return load_gguf(path, keep_blocks=quantization == "gguf")
    if path.is_dir():
        return load_safetensors(path)
    raise ModelLoadError(
        f"{path} is neither a .gguf file nor a folder; give a GGUF file or a Hugging Face folder"
    )
