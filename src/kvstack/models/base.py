"""What the engine needs of a model family: the `CausalLM` interface and the `ModelFamily`
value each family registers (its architectures, how it reads a config, which tensors it needs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from kvstack.config import ModelConfig
from kvstack.kernels.gguf import GGUFLinear
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.layers.attention import LayerHook, StepMetadata


class CausalLM(Protocol):
    """A decoder-only model run over a flattened batch of new tokens and the paged KV cache.

    Contracts: `forward` writes each new token's K/V into its slot (`meta.slot_mapping`) and
    attends over the slots `meta` names; a row's result never depends on the other rows of
    its step; `compute_logits` returns float32 whatever the model dtype.
    """

    dtype: torch.dtype
    use_kernels: bool  # the C decode kernels may run (False: the PyTorch reference path)

    @property
    def config(self) -> ModelConfig:
        """The model's config (read-only here, so a family's own subclass of it fits)."""
        ...

    def load_weights(self, tensors: Mapping[str, torch.Tensor],
                     blocks: Mapping[str, GGUFLinear] | None = None) -> None:
        """Take Hugging Face-named tensors in [out, in] layout, and weights a GGUF file keeps
        as quantized blocks (quantization="gguf")."""
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
                kv_storage: KVCacheStorage | None,
                hook: LayerHook | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] after the final norm.
        `hook`: a feature's part in the layer loop (`LayerHook`), after each layer's Q/K/V."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]."""
        ...

    @property
    def num_weight_bytes(self) -> int:
        """Bytes of the weights as held (a tied head counts once)."""
        ...


# (config, dtype, quantization, use_kernels) -> a model with no weights loaded yet
ModelFactory = Callable[[ModelConfig, torch.dtype, str | None, bool], CausalLM]


@dataclass(frozen=True)
class ModelFamily:
    """One architecture family: the model class and the checks its weights must pass."""

    name: str
    architectures: tuple[str, ...]  # Hugging Face `architectures` names it runs
    create: ModelFactory
    # A config.json-style dict -> ModelConfig, refusing variants the family cannot run
    # (raises UnsupportedModelError / ModelLoadError naming `source`).
    config_from_hf: Callable[[dict[str, Any], Path], ModelConfig]
    # HF tensor name -> shape of every tensor the model reads.
    expected_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    # Jinja chat template for model files that carry none (None: such files take plain
    # prompts only).
    chat_template: str | None = None
