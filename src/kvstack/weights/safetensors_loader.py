"""Hugging Face folders: config.json + model.safetensors, or shards listed in an index."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from kvstack.errors import ModelLoadError, one_line
from kvstack.weights.checkpoint import (
    Checkpoint,
    check_tensors,
    fingerprint_files,
    model_config_from_hf,
)

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Everything AutoTokenizer may read; hashed into the fingerprint when present.
_TOKENIZER_FILES = (
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "merges.txt",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
)


def load_safetensors(folder: Path) -> Checkpoint:
    """Load every tensor in the file's dtype; ties and rope buffers resolved, shapes checked."""
    hf_config = _read_json(folder / "config.json", folder)
    config = model_config_from_hf(hf_config, folder)
    files = _weight_files(folder)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors |= _read_safetensors(file)
    # Older transformers saved rope inverse frequencies; they are recomputed from the config.
    tensors = {n: t for n, t in tensors.items() if not n.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        # Some tied checkpoints still store a copy of the embedding as the head.
        tensors.pop("lm_head.weight", None)
    check_tensors(tensors, config, folder)
    hashed = [folder / "config.json", *files]
    hashed += [folder / name for name in _TOKENIZER_FILES if (folder / name).is_file()]
    return Checkpoint(
        config=config,
        hf_config=hf_config,
        tensors=tensors,
        tokenizer_path=folder,
        tokenizer_gguf_file=None,
        fingerprint=fingerprint_files(hashed),
        source="safetensors",
    )


def _read_json(path: Path, folder: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(
            f"{folder} has no {path.name}; give a Hugging Face model folder "
            "(config.json + *.safetensors) or a .gguf file"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"cannot parse {path} ({one_line(err)}); re-download it") from err
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object; re-download it")
    return data


def _weight_files(folder: Path) -> list[Path]:
    if (folder / _INDEX).is_file():
        weight_map = _read_json(folder / _INDEX, folder).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{folder / _INDEX} has no weight_map; re-download it")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(
                    f"{folder} lacks shard {file.name} listed in {_INDEX}; re-download it"
                )
        return files
    if (folder / _SINGLE).is_file():
        return [folder / _SINGLE]
    raise ModelLoadError(
        f"{folder} has neither {_SINGLE} nor {_INDEX}; save the model with safe_serialization"
    )


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(file)
    except Exception as err:  # SafetensorError, OSError, or torch errors on a bad header
        raise ModelLoadError(
            f"cannot read {file} ({one_line(err)}); the file is corrupt, re-download it"
        ) from err
