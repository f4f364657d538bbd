"""A tiny random Qwen3.5 text model (three Gated DeltaNet layers, then a gated attention
layer, twice): a Hugging Face folder from transformers' own config class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

LAYERS = ["linear_attention"] * 3 + ["full_attention"]


def tiny_qwen3_5_config(**overrides: Any) -> Any:
    kwargs: dict[str, Any] = {
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 8, "layer_types": LAYERS * 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        # std 0.02 gives nearly flat logits, whose greedy choices tie
        "initializer_range": 0.15, "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    return Qwen3_5TextConfig(**(kwargs | overrides))


def make_tiny_qwen3_5_folder(root: Path, **overrides: Any) -> Path:
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(tiny_qwen3_5_config(**overrides)).eval()
    folder = root / "tiny-qwen3_5"
    model.save_pretrained(folder)
    return folder
