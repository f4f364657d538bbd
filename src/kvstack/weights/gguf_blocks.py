"""GGUF linear weights kept as the file's quantized blocks (`quantization="gguf"`), and the
Q/K row order llama.cpp's converter stores, undone for dense and block weights alike."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import gguf
import torch

from kvstack.config import ModelConfig
from kvstack.kernels.gguf import GGUFLinear, UnsupportedGGUFTensor

log = logging.getLogger("kvstack.weights")

# HF names of the weights that may stay as blocks: every linear layer, the LM head and the
# embedding table (its rows are dequantized on lookup; a tied one is the head too).
_LINEAR_SUFFIXES = ("_proj.weight", "lm_head.weight", "embed_tokens.weight")


def is_linear_weight(hf_name: str) -> bool:
    return hf_name.endswith(_LINEAR_SUFFIXES)


def as_blocks(info: gguf.ReaderTensor) -> GGUFLinear | None:
    """The tensor as a `GGUFLinear` (kernels chosen later, by the model), or None where no
    kernel runs its type or width (F32/F16/BF16, Q2_K, Q3_K, Q5_K, ...)."""
    try:
        return GGUFLinear.from_reader_tensor(info, use_kernels=False)
    except UnsupportedGGUFTensor:
        return None


def take_blocks(info: gguf.ReaderTensor, hf_name: str, blocks: dict[str, GGUFLinear],
                fallbacks: list[tuple[str, str]]) -> bool:
    """Put a linear weight a kernel runs into `blocks` (True); a linear weight without one is
    recorded in `fallbacks` (for `notice_fallbacks`) and, like any other tensor, left to the
    caller to dequantize (False)."""
    if not is_linear_weight(hf_name):
        return False
    lin = as_blocks(info)
    if lin is None:
        fallbacks.append((info.name, info.tensor_type.name))
        return False
    blocks[hf_name] = lin
    return True


def notice_fallbacks(fallbacks: Iterable[tuple[str, str]], path: Path) -> None:
    """One line naming the weights dequantized because no GGUF kernel runs their type."""
    by_type: dict[str, int] = {}
    for _, type_name in fallbacks:
        by_type[type_name] = by_type.get(type_name, 0) + 1
    if by_type:
        counts = ", ".join(f"{n} {t}" for t, n in sorted(by_type.items()))
        log.warning("%s: %s linear weight(s) dequantized (no GGUF kernel for that type); "
                    "the rest run as quantized blocks", path.name, counts)


def unpermute_qk(tensors: dict[str, torch.Tensor], blocks: dict[str, GGUFLinear],
                 config: ModelConfig) -> None:
    """Put Q/K rows (and biases) back in Hugging Face order, in place in both dicts."""
    for i in range(config.num_layers):
        for proj, num_heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
            for suffix in ("weight", "bias"):
                name = f"model.layers.{i}.self_attn.{proj}.{suffix}"
                if name in tensors:
                    tensors[name] = unpermute(tensors[name], num_heads)
                if name in blocks:
                    # Rows are whole blocks: move each row's bytes to where HF has it.
                    lin = blocks[name]
                    order = unpermute(torch.arange(lin.out_features)[:, None], num_heads)[:, 0]
                    blocks[name] = lin.take_rows(order)


def unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    # Per head, convert_hf_to_gguf maps HF row (half, i) to row (i, half) so that llama.cpp's
    # rope rotates adjacent pairs: rows [H, 2, D/2] -> [H, D/2, 2]. Swap back.
    rest = w.shape[1:]
    return (
        w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(w.shape)
        .contiguous()
    )
