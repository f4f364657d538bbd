"""A model's linear layers built from a checkpoint: dense weights become `Linear` (model dtype
or int8), GGUF blocks (`quantization="gguf"`) stay `GGUFLinear`, and fused projections (QKV,
gate/up) are one layer where their parts allow it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvstack.errors import ModelLoadError
from kvstack.kernels.gguf import ConcatLinear, GGUFLinear, UnsupportedGGUFTensor
from kvstack.kernels.linear import Linear

AnyLinear = Linear | GGUFLinear | ConcatLinear


class LinearBuilder:
    """Reads HF-named tensors (and GGUF blocks) of one checkpoint into the model's layers."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], blocks: Mapping[str, GGUFLinear],
                 dtype: torch.dtype, quantization: str | None, use_kernels: bool) -> None:
        self.tensors, self.blocks = tensors, blocks
        self.dtype, self.use_kernels = dtype, use_kernels
        # Weights a GGUF run dequantized (no kernel for their type) run in the model dtype.
        self.dense_quantization = None if quantization == "gguf" else quantization

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ModelLoadError(f"checkpoint lacks tensor {name!r}; the file is incomplete")
        return self.tensors[name].to(self.dtype)

    def fused(self, names: Sequence[str], bias_names: Sequence[str] | None = None) -> AnyLinear:
        """One layer computing the named weights' outputs one after another (e.g. q, k, v)."""
        biases: list[torch.Tensor | None] = (
            [self.tensor(b) for b in bias_names] if bias_names else [None] * len(names))
        if len(names) == 1:
            return self._single(names[0], biases[0])
        if not any(n in self.blocks for n in names):
            weight = torch.cat([self.tensor(n) for n in names], dim=0)
            bias = torch.cat([b for b in biases if b is not None]) if bias_names else None
            return self._dense(weight, bias)
        parts = [self._single(n, b) for n, b in zip(names, biases, strict=True)]
        if all(isinstance(p, GGUFLinear) for p in parts):
            try:
                return GGUFLinear.cat(parts)  # type: ignore[arg-type]
            except UnsupportedGGUFTensor:  # mixed types (e.g. Q4_K_M's q/k vs v)
                pass
        return ConcatLinear(parts)

    def embedding_and_head(self, tied: bool) -> tuple[torch.Tensor | GGUFLinear | None,
                                                       AnyLinear]:
        """(embedding table, LM head). The table is None where the head's int8 rows serve
        lookups; a tied GGUF table is the head itself (rows dequantized on lookup)."""
        name = "model.embed_tokens.weight"
        if name in self.blocks:
            embed: torch.Tensor | GGUFLinear = self._gguf(name, None)
        else:
            embed = self.tensor(name).contiguous()
        if tied:
            head: AnyLinear = embed if isinstance(embed, GGUFLinear) else self._dense(embed, None)
        else:
            head = self._single("lm_head.weight", None)
        if tied and isinstance(head, Linear) and head.scale is not None:
            return None, head
        return embed, head

    def _single(self, name: str, bias: torch.Tensor | None) -> AnyLinear:
        if name in self.blocks:
            return self._gguf(name, bias)
        return self._dense(self.tensor(name), bias)

    def _gguf(self, name: str, bias: torch.Tensor | None) -> GGUFLinear:
        # The checkpoint's layer shares its blocks; kernels as this model runs them.
        b = self.blocks[name]
        return GGUFLinear(b.blocks, b.qtype, (b.out_features, b.in_features), bias,
                          use_kernels=self.use_kernels)

    def _dense(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        return Linear(weight, bias, self.dtype, self.dense_quantization, self.use_kernels)
