"""Gemma 3 GGUF files (llama.cpp arch `gemma3`) -> a Checkpoint in Hugging Face names and layout.

Conventions of llama.cpp's converter (convert_hf_to_gguf.py, Gemma3Model) undone here, checked
against transformers' own GGUF loader (Gemma2TensorProcessor), which is the reference:
- every `*norm.weight` (attention/MLP pre- and post-norms, QK-norms, final norm) is stored as
  1 + w, HF stores w: subtract 1;
- Q/K rows are NOT permuted (llama.cpp runs Gemma with NEOX-style rope, HF's rotate_half), so
  blocks kept as they are (`keep_blocks`) need no row reordering either;
- the file has no token-embedding scale, output head (tied), local RoPE base or layer pattern:
  llama.cpp hard-codes them for gemma3 (local base 1e4, every sixth layer global), as do
  transformers' Gemma3TextConfig defaults; query_pre_attn_scalar follows llama.cpp (head_dim,
  except the 27B's hidden / heads).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import torch

from kvstack.errors import ModelLoadError, UnsupportedModelError
from kvstack.kernels.gguf import GGUFLinear
from kvstack.weights.checkpoint import (
    Checkpoint,
    check_tensors,
    fingerprint_files,
    model_config_from_hf,
)
from kvstack.weights.gguf_blocks import notice_fallbacks, take_blocks
from kvstack.weights.gguf_read import dequantize_tensor, gguf_value, required_value

ARCH = "gemma3"
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
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp (llama-model.cpp, LLM_ARCH_GEMMA3): local RoPE base, one global layer in six, and
# the 62-layer 27B scaling queries by hidden / heads rather than head_dim.
_LOCAL_ROPE_THETA = 10_000.0
_SLIDING_WINDOW_PATTERN = 6
_GEMMA3_27B_LAYERS = 62
# The instruction-tuned models end a turn with this token; stopping on it is harmless for base
# weights (they only emit it inside the turn format).
_END_OF_TURN = "<end_of_turn>"


def load_gemma3_gguf(reader: gguf.GGUFReader, path: Path, keep_blocks: bool = False
                     ) -> Checkpoint:
    """Dequantize every tensor of a gemma3 GGUF to float32, in HF names, norms as HF's w; with
    `keep_blocks`, linear weights (and the embedding table, the tied head) of a type a GGUF
    kernel runs stay as blocks (`Checkpoint.blocks`), the others are dequantized with a
    one-line notice."""
    infos = {t.name: t for t in reader.tensors}
    hf_config = gemma3_hf_config(reader, infos, path)
    config = model_config_from_hf(hf_config, path)
    tensors: dict[str, torch.Tensor] = {}
    blocks: dict[str, GGUFLinear] = {}
    fallbacks: list[tuple[str, str]] = []
    for name, info in infos.items():
        hf_name = gemma3_hf_name(name, path)
        if keep_blocks and take_blocks(info, hf_name, blocks, fallbacks):
            continue
        tensor = dequantize_tensor(info, path)
        if name.endswith("norm.weight"):
            tensor = tensor - 1.0  # stored as 1 + w; fp32 as transformers computes it
        tensors[hf_name] = tensor
    notice_fallbacks(fallbacks, path)
    check_tensors({**tensors, **blocks}, config, path)
    return Checkpoint(
        config=config,
        hf_config=hf_config,
        tensors=tensors,
        tokenizer_path=path.parent,
        tokenizer_gguf_file=path.name if reader.get_field("tokenizer.ggml.model") else None,
        fingerprint=fingerprint_files([path]),
        source="gguf",
        blocks=blocks,
    )


def gemma3_hf_name(name: str, path: Path) -> str:
    """GGUF tensor name -> HF parameter name (`blk.3.ffn_norm.weight` ->
    `model.layers.3.pre_feedforward_layernorm.weight`)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise UnsupportedModelError(
        f"{path} has tensor {name} that Gemma 3 does not use; this model variant is not supported"
    )


def gemma3_hf_config(
    reader: gguf.GGUFReader, infos: dict[str, gguf.ReaderTensor], path: Path
) -> dict[str, Any]:
    """The Gemma3TextConfig dict (transformers 5 layout) that transformers' GGUF loader builds
    for this file, plus <end_of_turn> among the EOS ids."""

    def required(key: str) -> Any:
        return required_value(reader, f"{ARCH}.{key}", path)

    if "token_embd.weight" not in infos:
        raise ModelLoadError(f"{path} lacks tensor token_embd.weight; re-download or re-convert it")
    hidden = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    num_layers = int(required("block_count"))
    head_dim = int(gguf_value(reader, f"{ARCH}.attention.key_length") or hidden // num_heads)
    full_rope = _full_rope(reader, path, required)
    bos, pad = (gguf_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "padding"))
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": int(infos["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(required("feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(
            gguf_value(reader, f"{ARCH}.attention.head_count_kv") or num_heads
        ),
        "head_dim": head_dim,
        "max_position_embeddings": int(required("context_length")),
        "rms_norm_eps": float(required("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {
            "full_attention": full_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": _LOCAL_ROPE_THETA},
        },
        "sliding_window": int(required("attention.sliding_window")),
        "layer_types": [
            "sliding_attention" if (i + 1) % _SLIDING_WINDOW_PATTERN else "full_attention"
            for i in range(num_layers)
        ],
        "query_pre_attn_scalar": (
            hidden // num_heads if num_layers == _GEMMA3_27B_LAYERS else head_dim
        ),
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": "output.weight" not in infos,
        "attention_bias": False,
        "bos_token_id": None if bos is None else int(bos),
        "pad_token_id": None if pad is None else int(pad),
        "eos_token_id": _eos_ids(reader),
    }


def _full_rope(reader: gguf.GGUFReader, path: Path,
               required: Callable[[str], Any]) -> dict[str, Any]:
    """The global layers' RoPE parameters (the sliding layers' are fixed for Gemma 3)."""
    full_rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(gguf_value(reader, f"{ARCH}.rope.freq_base") or 1_000_000.0),
    }
    kind = gguf_value(reader, f"{ARCH}.rope.scaling.type")
    if kind == "linear":  # Gemma 3 4B and up: global layers only
        return {**full_rope, "rope_type": "linear",
                "factor": float(required("rope.scaling.factor"))}
    if kind not in (None, "none"):
        raise UnsupportedModelError(f"{path}: rope scaling {kind!r} is not supported (linear)")
    return full_rope


def _eos_ids(reader: gguf.GGUFReader) -> list[int] | int | None:
    ids = [
        int(v)
        for key in ("eos_token_id", "eot_token_id")
        if (v := gguf_value(reader, f"tokenizer.ggml.{key}")) is not None
    ]
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is not None:
        # Gemma's special tokens sit near the start of the vocabulary (<end_of_turn> is 106);
        # scanning the raw parts avoids decoding all 262k strings.
        wanted = _END_OF_TURN.encode()
        for i, part in enumerate(tokens.data[:1024]):
            if bytes(tokens.parts[part]) == wanted:
                ids.append(i)
                break
    ids = list(dict.fromkeys(ids))
    return ids[0] if len(ids) == 1 else (ids or None)
