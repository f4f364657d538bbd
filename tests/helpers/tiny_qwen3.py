"""Tiny random Qwen3 and Qwen3-MoE models: Hugging Face folders from transformers' own config
classes, and GGUF files (arch qwen3 / qwen3moe) written from them the way convert_hf_to_gguf
does (experts stacked into 3-D ffn_*_exps tensors, the router F32, no Q/K permutation).

Widths are multiples of 256 so that every GGUF type, K-quants included, applies.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from helpers.tiny_models import _add

VARIANTS = ("dense", "tied", "moe", "moe_mixed")
# Qwen3-30B-A3B's routing (128 experts, top-8, renormalized) on one narrow layer.
REAL_ROUTING = "moe128"
_BASE: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}
_MOE: dict[str, Any] = {"moe_intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2}


def tiny_qwen3_config(variant: str, **overrides: Any) -> Any:
    """dense: untied GQA; tied: tied head, MHA; moe: every layer sparse, 8 experts top-2,
    renormalized; moe_mixed: layer 0 dense (mlp_only_layers), top-3 not renormalized."""
    kwargs = _BASE | overrides
    if variant == "dense":
        return Qwen3Config(**kwargs)
    if variant == "tied":
        return Qwen3Config(**(kwargs | {"tie_word_embeddings": True, "num_key_value_heads": 4}))
    if variant == "moe":
        return Qwen3MoeConfig(**(_MOE | {"norm_topk_prob": True} | kwargs))
    if variant == "moe_mixed":
        return Qwen3MoeConfig(**(_MOE | {"norm_topk_prob": False, "num_experts_per_tok": 3,
                                         "mlp_only_layers": [0]} | kwargs))
    if variant == REAL_ROUTING:
        return Qwen3MoeConfig(**(_MOE | {"norm_topk_prob": True, "num_experts": 128,
                                         "num_experts_per_tok": 8, "moe_intermediate_size": 64,
                                         "num_hidden_layers": 1} | kwargs))
    raise ValueError(f"unknown variant {variant!r}; use one of {VARIANTS}")


def make_tiny_qwen3_folder(tmp_path: Path, variant: str, **overrides: Any) -> Path:
    """A seeded random model saved as config.json + safetensors; norms near 1 (not all 1, so
    a q/k norm mix-up shows), weights with std 0.05 (greedy tokens rarely tie)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(variant, **overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1 and "norm" in name:
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, 0.05)
    folder = tmp_path / f"tiny-qwen3-{variant}"
    model.save_pretrained(folder)
    return folder


_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
}


def write_qwen3_gguf(path: Path, hf_folder: Path, tensor_type: QType) -> Path:
    """The folder as a GGUF file: 2-D and 3-D weights as `tensor_type`, 1-D ones and the
    router F32 (as llama.cpp keeps them)."""
    hf = json.loads((hf_folder / "config.json").read_text())
    tensors = load_file(hf_folder / "model.safetensors")
    moe = hf["model_type"] == "qwen3_moe"
    writer = gguf.GGUFWriter(path, "qwen3moe" if moe else "qwen3")
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_key_length(hf["head_dim"])
    writer.add_value_length(hf["head_dim"])
    writer.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_vocab_size(hf["vocab_size"])
    writer.add_bos_token_id(hf["bos_token_id"])
    writer.add_eos_token_id(hf["eos_token_id"])
    if moe:
        writer.add_expert_count(hf.get("num_experts") or hf["num_local_experts"])
        writer.add_expert_used_count(hf["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(hf["moe_intermediate_size"])
        writer.add_expert_weights_norm(hf["norm_topk_prob"])
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in tensors.items():
        if name == "lm_head.weight" and hf.get("tie_word_embeddings"):
            continue
        w = tensor.float().numpy()
        if ".experts." in name:  # model.layers.L.mlp.experts.E.gate_proj.weight
            parts = name.split(".")
            key = f"blk.{parts[2]}.ffn_{parts[6].removesuffix('_proj')}_exps.weight"
            experts.setdefault(key, {})[int(parts[5])] = w
            continue
        gname = _GLOBAL.get(name) or _layer_name(name)
        _add(writer, gname, w, tensor_type if w.ndim == 2 and "ffn_gate_inp" not in gname
             else QType.F32)
    for key, by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in range(len(by_expert))])
        num, rows, cols = stacked.shape
        if tensor_type == QType.F32:
            writer.add_tensor(key, stacked.astype(np.float32))
            continue
        flat = gguf.quants.quantize(stacked.reshape(num * rows, cols), tensor_type)
        writer.add_tensor(key, flat.reshape(num, rows, -1), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _layer_name(hf_name: str) -> str:
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"
