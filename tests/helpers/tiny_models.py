"""Tiny random-weight models for tests: Hugging Face folders, and GGUF files written from them.

Sizes are multiples of 256 so that every GGUF type, K-quants included (QK_K = 256), applies.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
)

VARIANTS = ("mha", "gqa", "mqa", "qkv_bias", "tied", "untied", "llama3_rope", "mistral")
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
_BASE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def tiny_config(variant: str, **overrides: Any) -> PretrainedConfig:
    """The transformers config of a variant (see VARIANTS); `overrides` replace base fields
    (e.g. num_hidden_layers)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny model variant {variant!r}; use one of {VARIANTS}")
    kwargs = dict(_BASE)
    kwargs["num_key_value_heads"] = {"mha": 4, "mqa": 1}.get(variant, 2)
    kwargs["tie_word_embeddings"] = variant == "tied"
    kwargs.update(overrides)
    if variant == "qkv_bias":
        return Qwen2Config(**kwargs)
    if variant == "mistral":
        return MistralConfig(**kwargs, sliding_window=None)
    if variant == "llama3_rope":
        kwargs["rope_scaling"] = dict(LLAMA3_ROPE)
    return LlamaConfig(**kwargs)


def make_tiny_hf_folder(
    tmp_path: Path,
    variant: str,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Save a seeded random model of `variant` as config.json + safetensors; return the folder."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(variant, **overrides))
    with torch.no_grad():
        # Default init leaves norms at 1 and biases at 0, which would hide name or order mix-ups.
        for name, param in model.named_parameters():
            if param.ndim == 1 and "norm" in name:
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, 0.05)
    model.to(dtype)
    folder = tmp_path / f"tiny-{variant}-{str(dtype).removeprefix('torch.')}"
    if overrides:
        folder = folder.with_name(folder.name + "-" + "-".join(
            f"{k}{v}" for k, v in sorted(overrides.items())))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    return folder


# HF names -> GGUF names, spelled out independently of kvstack's loader.
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's reordering of Q/K rows for llama.cpp's interleaved rope."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def write_tiny_gguf(path: Path, hf_folder: Path, tensor_type: QType,
                    types: dict[str, QType] | None = None) -> Path:
    """Convert a (tiny) HF folder to GGUF the way convert_hf_to_gguf does, 2-D tensors as
    `tensor_type` (1-D ones stay F32, as in llama.cpp) or as `types` says by GGUF name (files
    that mix types, as Q4_K_M does). Qwen2 keeps arch qwen2, others llama."""
    hf = json.loads((hf_folder / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(hf_folder.glob("*.safetensors")):
        tensors |= load_file(file)
    rope = hf.get("rope_parameters") or {}
    theta = float(hf.get("rope_theta") or rope.get("rope_theta", 10000.0))
    arch = "qwen2" if hf["model_type"] == "qwen2" else "llama"
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_vocab_size(hf["vocab_size"])
    writer.add_bos_token_id(hf["bos_token_id"])
    writer.add_eos_token_id(hf["eos_token_id"])

    for name, tensor in tensors.items():
        if name == "lm_head.weight" and hf.get("tie_word_embeddings"):
            continue
        w = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            w = llama_cpp_permute(w, heads)
        elif arch == "llama" and ".k_proj." in name:
            w = llama_cpp_permute(w, kv_heads)
        qtype = (types or {}).get(gguf_name(name), tensor_type)
        _add(writer, gguf_name(name), w, qtype if w.ndim == 2 else QType.F32)
    if rope.get("rope_type") == "llama3":
        _add(writer, "rope_freqs.weight", _llama3_rope_freqs(rope, head_dim, theta), QType.F32)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: QType) -> None:
    if qtype == QType.F32:
        writer.add_tensor(name, w.astype(np.float32))
    elif qtype == QType.F16:
        writer.add_tensor(name, w.astype(np.float16))
    elif qtype in _K_QUANTIZERS:
        writer.add_tensor(name, quantize_k(w, qtype), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)


def _llama3_rope_freqs(rope: dict[str, Any], head_dim: int, theta: float) -> np.ndarray:
    # As convert_hf_to_gguf's LlamaModel.generate_extra_tensors: per-pair frequency divisors.
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    factor, old_len = rope["factor"], rope["original_max_position_embeddings"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# gguf 0.19 can dequantize K-quants but not quantize them. These test-only quantizers are
# plain round-to-nearest (llama.cpp searches scales, so its error is a bit lower) and pack
# bits in exactly the layout gguf.quants' dequantizers unpack; a packing mistake shows up as
# a round-trip error far above the tolerance.
def quantize_k(w: np.ndarray, qtype: QType) -> np.ndarray:
    """[rows, cols] float -> [rows, bytes] uint8 blocks of Q4_K, Q5_K or Q6_K."""
    blocks = w.astype(np.float32).reshape(-1, gguf.QK_K)
    return _K_QUANTIZERS[qtype](blocks).reshape(w.shape[0], -1)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _affine_subblocks(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    # 8 sub-blocks of 32: x ~ d * sc[j] * q - dmin * m[j], sc and m 6-bit, q in [0, levels].
    sub = blocks.reshape(len(blocks), 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / levels
    d = _f16(scale.max(-1) / 63)
    dmin = _f16(-lo.min(-1) / 63)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63)
    m = np.clip(np.round(np.divide(-lo, dmin32, out=np.zeros_like(lo), where=dmin32 > 0)), 0, 63)
    step = (d32 * sc)[..., None]
    shifted = sub + (dmin32 * m)[..., None]
    q = np.round(np.divide(shifted, step, out=np.zeros_like(sub), where=step > 0))
    q = np.clip(q, 0, levels)
    return d, dmin, _pack_k_scales(sc.astype(np.uint8), m.astype(np.uint8)), q.astype(np.uint8)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    # Inverse of gguf.quants.Q4_K.get_scale_min: 12 bytes for eight 6-bit scales and mins.
    low = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    high = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([low, mid, high], axis=1).astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    # Sub-blocks 2i and 2i+1 share 32 bytes: low and high nibble. q: [n, 8, 32] -> [n, 128]
    pairs = (q & 0x0F).reshape(len(q), 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(len(q), 128)


def _bytes(x: np.ndarray) -> np.ndarray:
    return x.reshape(len(x), -1).view(np.uint8)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _affine_subblocks(blocks, 15)
    return np.concatenate([_bytes(d), _bytes(dmin), scales, _nibbles(q)], axis=1)


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _affine_subblocks(blocks, 31)
    # Fifth bits: bit j of byte l is the high bit of sub-block j, element l.
    shifts = np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce((q >> 4) << shifts, axis=1).astype(np.uint8)  # [n, 32]
    return np.concatenate([_bytes(d), _bytes(dmin), scales, qh, _nibbles(q)], axis=1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    # 16 sub-blocks of 16: x ~ d * sc[s] * (q - 32), sc int8, q 6-bit.
    n = len(blocks)
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = _f16(scale.max(-1) / 127)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 127)
    step = (d32 * sc)[..., None]
    q = np.round(np.divide(sub, step, out=np.zeros_like(sub), where=step > 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    # Element h*128 + k*64 + b: low nibble k of ql[h*64 + b]; element h*128 + s*32 + l:
    # bits 2s..2s+1 of qh[h*32 + l] hold its top two bits.
    low = (q & 0x0F).reshape(n, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    high = (q >> 4).reshape(n, 2, 4, 32)
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qh = np.bitwise_or.reduce(high << shifts, axis=2).astype(np.uint8).reshape(n, 64)
    return np.concatenate([ql, qh, _bytes(sc.astype(np.int8)), _bytes(d)], axis=1)


_K_QUANTIZERS = {QType.Q4_K: _quantize_q4_k, QType.Q5_K: _quantize_q5_k, QType.Q6_K: _quantize_q6_k}


def make_tiny_chat_folder(tmp_path: Path, tokenizer: Any, context: int = 2048) -> Path:
    """A seeded random Llama small enough to run instantly, with a real tokenizer and chat
    template (the embedded model's `tokenizer`, saved beside it): what the HTTP server needs,
    at a fraction of a real model's cost. Its answers are gibberish, but deterministic."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**_BASE, "vocab_size": len(tokenizer), "hidden_size": 64,
                            "intermediate_size": 128, "head_dim": 16,
                            "max_position_embeddings": context})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.05)
    folder = tmp_path / "tiny-chat"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
