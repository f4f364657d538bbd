"""A loaded checkpoint in Hugging Face names and layout, whatever the file format."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstack.config import ModelConfig
from kvstack.errors import ModelLoadError, UnsupportedModelError
from kvstack.kernels.gguf import GGUFLinear
from kvstack.models import family_of


@dataclass(frozen=True)
class Checkpoint:
    """Weights plus what is needed to run and tokenize them.

    `tensors` uses Hugging Face parameter names and [out, in] layout; `lm_head.weight` is present
    only when the embeddings are untied. GGUF tensors are dequantized to float32 with llama.cpp's
    Q/K row permutation undone; safetensors keep the file's dtype. `fingerprint` is a sha256 over
    the weight and tokenizer files, so equal fingerprints mean the same weights and tokenizer.

    `blocks` (GGUF with `quantization="gguf"` only) holds linear weights, the LM head and the
    embedding table as the file's quantized blocks, rows already in HF order; a name is in
    `tensors` or in `blocks`, never both.
    """

    config: ModelConfig
    hf_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer_path: Path
    tokenizer_gguf_file: str | None
    fingerprint: str
    source: str
    blocks: Mapping[str, GGUFLinear] = field(default_factory=dict)


def model_config_from_hf(hf_config: dict[str, Any], source: Path) -> ModelConfig:
    """ModelConfig of a config.json-style dict, by the family that runs its architecture."""
    archs = hf_config.get("architectures") or [hf_config.get("model_type", "unknown")]
    try:
        family = family_of(archs[0])
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{source}: {err}") from None
    return family.config_from_hf(hf_config, source)


def check_tensors(tensors: Mapping[str, torch.Tensor | GGUFLinear], config: ModelConfig,
                  source: Path) -> None:
    """Every expected tensor present with its shape, and nothing the model would ignore."""
    expected = family_of(config.architecture).expected_shapes(config)
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ModelLoadError(
            f"{source} lacks tensor {missing[0]} ({len(missing)} missing); "
            "the file is incomplete, re-download or re-convert it"
        )
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise UnsupportedModelError(
            f"{source} has tensor {unexpected[0]} that {config.architecture} does not use; "
            "this model variant is not supported"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {tuple(tensors[name].shape)} but the config "
                f"implies {shape}; the config does not match the weights"
            )


def fingerprint_files(paths: Iterable[Path]) -> str:
    """sha256 over the files' bytes in the given order, each prefixed by its length."""
    digest = hashlib.sha256()
    for path in paths:
        # The length prefix keeps file boundaries unambiguous; names are left out so that a
        # renamed copy of the same weights keeps its caches.
        digest.update(path.stat().st_size.to_bytes(8, "little"))
        with path.open("rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
    return digest.hexdigest()
