"""A loaded checkpoint in Hugging Face names and layout, whatever the file format."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstack.config import ModelConfig
from kvstack.errors import ModelLoadError, UnsupportedModelError
from kvstack.weights.resolve import resolve_model

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class Checkpoint:
    """Weights plus what is needed to run and tokenize them.

    `tensors` uses Hugging Face parameter names and [out, in] layout; `lm_head.weight` is present
    only when the embeddings are untied. GGUF tensors are dequantized to float32 with llama.cpp's
    Q/K row permutation undone; safetensors keep the file's dtype. `fingerprint` is a sha256 over
    the weight and tokenizer files, so equal fingerprints mean the same weights and tokenizer.
    """

    config: ModelConfig
    hf_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer_path: Path
    tokenizer_gguf_file: str | None
    fingerprint: str
    source: str


def load_checkpoint(model: str) -> Checkpoint:
    """Load `smollm2-135m`, a .gguf file, or a Hugging Face folder (config.json + safetensors)."""
    path = resolve_model(model)
    # Imported here because both loaders import this module for Checkpoint.
    if path.is_file() and path.suffix == ".gguf":
        from kvstack.weights.gguf_loader import load_gguf

        return load_gguf(path)
    if path.is_dir():
        from kvstack.weights.safetensors_loader import load_safetensors

        return load_safetensors(path)
    raise ModelLoadError(
        f"{path} is neither a .gguf file nor a folder; give a GGUF file or a Hugging Face folder"
    )


def model_config_from_hf(hf_config: dict[str, Any], source: Path) -> ModelConfig:
    """ModelConfig of a config.json-style dict, refusing what the Llama-family model can't run."""
    archs = hf_config.get("architectures") or [hf_config.get("model_type", "unknown")]
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: architecture {archs[0]} is not supported; "
            f"use one of {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if hf_config.get("hidden_act", "silu") != "silu" or hf_config.get("mlp_bias"):
        raise UnsupportedModelError(
            f"{source}: only SiLU MLPs without bias are supported "
            f"(hidden_act={hf_config.get('hidden_act')}, mlp_bias={hf_config.get('mlp_bias')})"
        )
    hf = dict(hf_config)
    window = _sliding_window(hf)
    if window is not None and window < hf.get("max_position_embeddings", window + 1):
        # Attention is full, so it is exact only while the context fits in the window.
        hf["max_position_embeddings"] = window
    try:
        return ModelConfig.from_hf(hf)
    except (KeyError, TypeError) as err:
        raise ModelLoadError(
            f"{source}: model config lacks or mistypes {err}; the config is not a Llama-family one"
        ) from err


def _sliding_window(hf: dict[str, Any]) -> int | None:
    if hf.get("model_type") == "qwen2" and not hf.get("use_sliding_window"):
        return None
    return hf.get("sliding_window")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape of every tensor the Llama-family model reads."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config.num_layers):
        layer = f"model.layers.{i}."
        attn, mlp = layer + "self_attn.", layer + "mlp."
        shapes |= {
            layer + "input_layernorm.weight": (hidden,),
            layer + "post_attention_layernorm.weight": (hidden,),
            attn + "q_proj.weight": (q_rows, hidden),
            attn + "k_proj.weight": (kv_rows, hidden),
            attn + "v_proj.weight": (kv_rows, hidden),
            attn + "o_proj.weight": (hidden, q_rows),
            mlp + "gate_proj.weight": (inter, hidden),
            mlp + "up_proj.weight": (inter, hidden),
            mlp + "down_proj.weight": (hidden, inter),
        }
        if config.attention_bias:
            shapes |= {
                attn + "q_proj.bias": (q_rows,),
                attn + "k_proj.bias": (kv_rows,),
                attn + "v_proj.bias": (kv_rows,),
            }
    return shapes


def check_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig, source: Path) -> None:
    """Every expected tensor present with its shape, and nothing the model would ignore."""
    expected = expected_shapes(config)
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


def one_line(err: BaseException) -> str:
    """An exception's message squeezed onto one short line, for wrapping in a user error."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 200 else text[:197] + "..."
