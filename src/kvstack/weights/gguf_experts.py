"""A GGUF file's 3-D expert tensors (`blk.N.ffn_{gate,up,down}_exps.weight`, ggml dims [in,
out, experts]) split into one weight per expert, in Hugging Face's per-expert names.

Each expert's slice of a 3-D tensor is contiguous (experts are the outermost dimension), so with
`keep_blocks` an expert's weight is its slice of the file's blocks, run by the GGUF kernels as
any other linear weight; otherwise (or for a type no kernel runs) it is dequantized.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import torch

from kvstack.errors import ModelLoadError
from kvstack.kernels.gguf import GGUFLinear, UnsupportedGGUFTensor
from kvstack.weights.gguf_read import dequantize_tensor

EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


def split_experts(info: gguf.ReaderTensor, keep_blocks: bool, tensors: dict[str, torch.Tensor],
                  blocks: dict[str, GGUFLinear], fallbacks: list[tuple[str, str]],
                  path: Path) -> None:
    """Add one weight per expert of `info` (an EXPERT_TENSOR) to `blocks` or `tensors`."""
    match = EXPERT_TENSOR.fullmatch(info.name)
    assert match is not None
    layer, part = match.groups()
    dims = [int(d) for d in info.shape]
    if len(dims) != 3:
        raise ModelLoadError(f"{path}: {info.name} has dims {dims}; expert tensors are 3-D")
    in_features, out_features, num_experts = dims
    names = [f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight"
             for e in range(num_experts)]
    if keep_blocks:
        data = info.data.reshape(num_experts, -1)
        try:
            for name, e in zip(names, range(num_experts), strict=True):
                blocks[name] = GGUFLinear(data[e], info.tensor_type,
                                          (out_features, in_features), use_kernels=False)
            return
        except UnsupportedGGUFTensor:
            fallbacks.append((info.name, info.tensor_type.name))
    dense = dequantize_tensor(info, path).reshape(num_experts, out_features, in_features)
    for name, e in zip(names, range(num_experts), strict=True):
        tensors[name] = dense[e]
