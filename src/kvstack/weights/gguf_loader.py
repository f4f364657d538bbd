"""GGUF files (llama.cpp) -> float32 tensors in Hugging Face names and a config.json-style dict;
with `keep_blocks`, the linear weights stay as the file's quantized blocks (`gguf_blocks`)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch

from kvstack.errors import ModelLoadError, UnsupportedModelError
from kvstack.kernels.gguf import GGUFLinear
from kvstack.weights.checkpoint import (
    Checkpoint,
    check_tensors,
    fingerprint_files,
    model_config_from_hf,
)
from kvstack.weights.gguf_blocks import notice_fallbacks, take_blocks, unpermute_qk
from kvstack.weights.gguf_experts import EXPERT_TENSOR, split_experts
from kvstack.weights.gguf_gemma3 import load_gemma3_gguf
from kvstack.weights.gguf_read import (
    check_tensor_types,
    dequantize_tensor,
    gguf_value,
    open_gguf,
    required_value,
)


class _Arch(NamedTuple):
    hf_class: str
    model_type: str
    attention_bias: bool
    # convert_hf_to_gguf reorders Q/K rows for llama.cpp's interleaved rope on these only.
    permuted_qk: bool


_ARCHITECTURES = {
    "llama": _Arch("LlamaForCausalLM", "llama", False, True),
    # Mistral without its sliding window is a Llama.
    "mistral": _Arch("LlamaForCausalLM", "llama", False, True),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", True, False),
    # llama.cpp runs Qwen3 with NEOX rope (HF's rotate_half): Q/K rows as HF has them.
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", False, False),
    "qwen3moe": _Arch("Qwen3MoeForCausalLM", "qwen3_moe", False, False),
}

_GEMMA3 = "gemma3"  # weights/gguf_gemma3.py

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"
# Llama 3's pre-training context; any value works (only ratios matter), this one reproduces
# the published low/high freq factors of Llama 3.x.
_LLAMA3_ORIGINAL_CONTEXT = 8192


def load_gguf(path: Path, keep_blocks: bool = False) -> Checkpoint:
    """Dequantize every tensor of a llama/qwen2/qwen3/qwen3moe/gemma3 GGUF to float32 and map
    it to HF names (3-D expert tensors split per expert); with `keep_blocks`, linear weights
    of a type a GGUF kernel runs stay as blocks instead (`Checkpoint.blocks`), the others
    are dequantized with a one-line notice."""
    reader = open_gguf(path)
    arch_name = gguf_value(reader, "general.architecture")
    if arch_name is None:
        raise ModelLoadError(f"{path} lacks general.architecture; the file is incomplete")
    if arch_name not in _ARCHITECTURES and arch_name != _GEMMA3:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch_name!r} is not supported "
            f"(supported: {', '.join([*_ARCHITECTURES, _GEMMA3])})"
        )
    infos = {t.name: t for t in reader.tensors}
    check_tensor_types(infos, path)
    if arch_name == _GEMMA3:  # its own names, norm convention and config
        return load_gemma3_gguf(reader, path, keep_blocks)
    arch = _ARCHITECTURES[arch_name]
    hf_config = _hf_config(reader, arch_name, arch, infos, path)
    config = model_config_from_hf(hf_config, path)

    tensors: dict[str, torch.Tensor] = {}
    blocks: dict[str, GGUFLinear] = {}
    fallbacks: list[tuple[str, str]] = []
    for name, info in infos.items():
        if name == _ROPE_FREQS:  # folded into hf_config["rope_scaling"]
            continue
        if EXPERT_TENSOR.fullmatch(name):  # 3-D: one weight per expert
            split_experts(info, keep_blocks, tensors, blocks, fallbacks, path)
            continue
        hf_name = _hf_name(name, path)
        if keep_blocks and take_blocks(info, hf_name, blocks, fallbacks):
            continue
        tensors[hf_name] = dequantize_tensor(info, path)
    notice_fallbacks(fallbacks, path)
    check_tensors({**tensors, **blocks}, config, path)
    if arch.permuted_qk:
        unpermute_qk(tensors, blocks, config)

    has_tokenizer = reader.get_field("tokenizer.ggml.model") is not None
    return Checkpoint(
        config=config,
        hf_config=hf_config,
        tensors=tensors,
        tokenizer_path=path.parent,
        tokenizer_gguf_file=path.name if has_tokenizer else None,
        fingerprint=fingerprint_files([path]),
        source="gguf",
        blocks=blocks,
    )


def _hf_config(
    reader: gguf.GGUFReader,
    prefix: str,
    arch: _Arch,
    infos: dict[str, gguf.ReaderTensor],
    path: Path,
) -> dict[str, Any]:
    def required(key: str) -> Any:
        return required_value(reader, f"{prefix}.{key}", path)

    if "token_embd.weight" not in infos:
        raise ModelLoadError(f"{path} lacks tensor token_embd.weight; re-download or re-convert it")
    hidden = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    head_dim = int(
        gguf_value(reader, f"{prefix}.attention.key_length")
        or gguf_value(reader, f"{prefix}.rope.dimension_count")
        or hidden // num_heads
    )
    rope_theta = float(gguf_value(reader, f"{prefix}.rope.freq_base") or 10000.0)
    eos_ids = [
        int(v)
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (v := gguf_value(reader, f"tokenizer.ggml.{key}")) is not None
    ]
    eos_ids = list(dict.fromkeys(eos_ids))
    bos = gguf_value(reader, "tokenizer.ggml.bos_token_id")
    return _moe_config(reader, prefix, infos) | {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        # The embedding's row count is authoritative (token lists are sometimes padded or short).
        "vocab_size": int(
            gguf_value(reader, f"{prefix}.vocab_size") or infos["token_embd.weight"].shape[1]
        ),
        "hidden_size": hidden,
        # An all-sparse MoE file may leave the dense width out: no layer reads it then.
        "intermediate_size": int(gguf_value(reader, f"{prefix}.feed_forward_length")
                                 or gguf_value(reader, f"{prefix}.expert_feed_forward_length")
                                 or required("feed_forward_length")),
        "num_hidden_layers": int(required("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(
            gguf_value(reader, f"{prefix}.attention.head_count_kv") or num_heads
        ),
        "head_dim": head_dim,
        "max_position_embeddings": int(required("context_length")),
        "rms_norm_eps": float(required("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(reader, prefix, infos, head_dim, rope_theta, path),
        "tie_word_embeddings": "output.weight" not in infos,
        "attention_bias": arch.attention_bias,
        "hidden_act": "silu",
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
    }


def _moe_config(reader: gguf.GGUFReader, prefix: str, infos: dict[str, gguf.ReaderTensor]
                ) -> dict[str, Any]:
    """Qwen3-MoE's keys. llama.cpp renormalizes qwen3moe's top-k weights whatever the file
    says (its qwen3moe graph passes norm_w=true; transformers' GGUF loader does the same). A
    layer without a router is a dense one (HF's mlp_only_layers)."""
    experts = gguf_value(reader, f"{prefix}.expert_count")
    if not experts:
        return {}
    layers = int(gguf_value(reader, f"{prefix}.block_count") or 0)
    return {
        "mlp_only_layers": [i for i in range(layers)
                            if f"blk.{i}.ffn_gate_inp.weight" not in infos],
        "num_experts": int(experts),
        "num_experts_per_tok": int(gguf_value(reader, f"{prefix}.expert_used_count") or 0),
        "moe_intermediate_size": int(
            gguf_value(reader, f"{prefix}.expert_feed_forward_length") or 0),
        "norm_topk_prob": True,
    }


def _rope_scaling(
    reader: gguf.GGUFReader,
    prefix: str,
    infos: dict[str, gguf.ReaderTensor],
    head_dim: int,
    theta: float,
    path: Path,
) -> dict[str, Any] | None:
    if _ROPE_FREQS in infos:
        factors = gguf.quants.dequantize(infos[_ROPE_FREQS].data, infos[_ROPE_FREQS].tensor_type)
        return _llama3_from_rope_freqs(factors.reshape(-1), head_dim, theta, path)
    kind = gguf_value(reader, f"{prefix}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = gguf_value(reader, f"{prefix}.rope.scaling.factor")
    if kind == "linear" and factor is not None:
        return {"rope_type": "linear", "factor": float(factor)}
    # Running with plain rope instead would silently give wrong outputs.
    raise UnsupportedModelError(
        f"{path}: rope scaling {kind!r} is not supported (supported: linear, llama3)"
    )


def _llama3_from_rope_freqs(
    factors: np.ndarray, head_dim: int, theta: float, path: Path
) -> dict[str, Any] | None:
    """Recover HF llama3 rope parameters from the per-pair frequency divisors llama.cpp stores.

    convert_hf_to_gguf writes 1 for short wavelengths, `factor` for long ones, and
    1 / ((1 - s) / factor + s) in between, where s = (1/wavelen - 1/W_low) / (1/W_high - 1/W_low)
    is linear in 1/wavelen. A line through the blended pairs gives both thresholds W_low and
    W_high, which is all llama3 scaling depends on.
    """
    factors = factors.astype(np.float64)
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return None
    inv_wavelen = (1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)) / (2 * math.pi)
    if len(factors) != len(inv_wavelen):
        raise ModelLoadError(
            f"{path}: {_ROPE_FREQS} has {len(factors)} values, expected {len(inv_wavelen)}; "
            "the file is inconsistent, re-convert it"
        )
    blended = ~np.isclose(factors, 1.0, rtol=1e-6) & ~np.isclose(factors, factor, rtol=1e-6)
    unsupported = UnsupportedModelError(
        f"{path}: {_ROPE_FREQS} is not llama3-style rope scaling; this model is not supported"
    )
    if blended.sum() < 2:
        raise unsupported
    smooth = (1 / factors[blended] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_wavelen[blended], smooth, 1)
    old_len = _LLAMA3_ORIGINAL_CONTEXT
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        # 5 significant digits undo float32 noise (256.000004 -> 256.0); checked below.
        "low_freq_factor": float(f"{old_len * -intercept / slope:.5g}"),
        "high_freq_factor": float(f"{old_len * (1 - intercept) / slope:.5g}"),
        "original_max_position_embeddings": old_len,
    }
    if not np.allclose(_llama3_divisors(inv_wavelen, scaling), factors, rtol=1e-4):
        raise unsupported
    return scaling


def _llama3_divisors(inv_wavelen: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    # The factors convert_hf_to_gguf would write for these parameters.
    old_len, factor = s["original_max_position_embeddings"], s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    smooth = (old_len * inv_wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(smooth >= 1, 1.0, np.where(smooth <= 0, factor, blended))


def _hf_name(name: str, path: Path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    raise UnsupportedModelError(
        f"{path} has tensor {name} that the Llama-family model does not use; "
        "this model variant is not supported"
    )


