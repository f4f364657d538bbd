"""Tiny random-weight Gemma 3 models for tests: an HF folder, and a GGUF written from it the way
llama.cpp's converter writes gemma3 files (norms stored as 1 + w, Q/K rows not permuted).

Dimensions are multiples of 256 so that K-quants (QK_K = 256) apply, like tiny_models.py.
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
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from helpers.tiny_models import quantize_k

WINDOW = 8
# Two global layers among sliding ones, one not at Gemma 3's every-sixth place. A GGUF stores no
# pattern: read back from one, these layers are llama.cpp's [sliding x 5, full].
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
               "sliding_attention", "full_attention"]
VARIANTS = ("mqa", "gqa")


def tiny_gemma3_config(variant: str = "mqa") -> Gemma3TextConfig:
    """Gemma 3 in small: MQA like the 270M (or GQA), a window of 8, local and global RoPE bases
    far apart (the global one linearly scaled, as on 4B and up), and query_pre_attn_scalar unlike
    head_dim, so a mix-up of any pair changes the logits."""
    if variant == "long":
        return _long_config()
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny Gemma 3 variant {variant!r}; use one of {VARIANTS}")
    return Gemma3TextConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=1 if variant == "mqa" else 2,
        head_dim=64,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        sliding_window=WINDOW,
        layer_types=list(LAYER_TYPES),
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        query_pre_attn_scalar=48,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=True,
    )


def _long_config() -> Gemma3TextConfig:
    """The 270M's layer plan in small ("long"): 18 layers, every sixth global, a window of 512,
    MQA, a context past 8,192 tokens; for the hybrid KV layout's memory at full length."""
    config = tiny_gemma3_config("mqa")
    config.hidden_size, config.intermediate_size = 64, 128
    config.num_attention_heads, config.head_dim = 2, 32
    config.num_hidden_layers, config.sliding_window = 18, 512
    config.layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                          for i in range(18)]
    config.max_position_embeddings = 16384
    return config


def make_tiny_gemma3_folder(tmp_path: Path, variant: str = "mqa") -> Path:
    """Save a seeded random tiny Gemma 3 as config.json + safetensors; return the folder."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_gemma3_config(variant), dtype=torch.float32)
    with torch.no_grad():
        # Gemma's norms scale by 1 + w and init w at 0: random w catches a missing "1 +" or a
        # swapped norm. Weights at 0.05 keep the 6 layers' logits in a few units.
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.1 if "norm" in name else 0.05)
    folder = tmp_path / f"tiny-gemma3-{variant}"
    model.save_pretrained(folder)
    return folder


# HF names -> llama.cpp's gemma3 names, spelled out independently of kvstack's loader.
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}"


def write_tiny_gemma3_gguf(path: Path, hf_folder: Path, tensor_type: QType,
                           types: dict[str, QType] | None = None) -> Path:
    """Convert a tiny Gemma 3 folder to a gemma3 GGUF as convert_hf_to_gguf does: 2-D tensors
    as `tensor_type` (or as `types` says by GGUF name, as Q4_K_M mixes them), 1-D ones (norms,
    stored as 1 + w) F32, no tokenizer. Like llama.cpp's files it stores neither the layer
    pattern nor the local RoPE base: readers assume Gemma 3's (every sixth layer global, base
    1e4), whatever the folder says."""
    hf: dict[str, Any] = json.loads((hf_folder / "config.json").read_text())
    tensors = load_file(hf_folder / "model.safetensors")
    rope = hf["rope_parameters"]
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_key_length(hf["head_dim"])
    writer.add_value_length(hf["head_dim"])
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    if rope["full_attention"].get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_sliding_window(hf["sliding_window"])
    writer.add_vocab_size(hf["vocab_size"])
    writer.add_bos_token_id(hf["bos_token_id"])
    writer.add_eos_token_id(hf["eos_token_id"])
    for name, tensor in tensors.items():
        if name == "lm_head.weight":
            continue  # tied
        w = tensor.float().numpy()
        if name.endswith("norm.weight"):
            w = w + 1.0  # convert_hf_to_gguf's Gemma norm_shift
        gguf_name = _gguf_name(name)
        qtype = (types or {}).get(gguf_name, tensor_type) if w.ndim == 2 else QType.F32
        _add(writer, gguf_name, w, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: QType) -> None:
    if qtype == QType.F32:
        writer.add_tensor(name, w.astype(np.float32))
    elif qtype in (QType.Q4_K, QType.Q5_K, QType.Q6_K):
        writer.add_tensor(name, quantize_k(w, qtype), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
