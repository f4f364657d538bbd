"""Qwen3 and Qwen3-MoE (Qwen3ForCausalLM, Qwen3MoeForCausalLM): config mapping and tensor
checks.

What differs from the Llama family (transformers' modeling_qwen3 / modeling_qwen3_moe are the
reference):
- q and k are RMS-normed per head (QK-norm, Llama's RMSNorm over head_dim) before RoPE;
- no QKV bias; head_dim is its own key (Qwen3-4B: 32 heads x 128 against hidden 2560);
- MoE: a layer is sparse where `num_experts > 0`, it is not in `mlp_only_layers` and
  (layer + 1) % `decoder_sparse_step` == 0; a sparse layer's MLP is a router [experts,
  hidden] picking the `num_experts_per_tok` highest of softmax(router logits), optionally
  renormalized to sum 1 (`norm_topk_prob`), each expert a SiLU-gated MLP of
  `moe_intermediate_size`; no shared expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.config import ModelConfig
from kvstack.errors import ModelLoadError, UnsupportedModelError
from kvstack.models.llama import expected_shapes as llama_shapes
from kvstack.models.llama import llama_config

QWEN3_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# The MoE block's kernels take any expert count and top-k up to this (Qwen3-30B-A3B: 128 / 8,
# Qwen3-235B-A22B: 128 / 8); more would only be slower, but nothing ships that way.
MAX_EXPERTS = 1024


@dataclass(frozen=True)
class Qwen3Config(ModelConfig):
    """Qwen3 hyper-parameters; the MoE ones are 0 / () for the dense model."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[bool, ...] = ()  # per layer: its MLP is the experts' block

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention_bias:
            raise UnsupportedModelError("Qwen3 with attention_bias=true is not supported")
        if not any(self.sparse_layers):
            return
        if len(self.sparse_layers) != self.num_layers:
            raise ModelLoadError("sparse_layers must list every layer; the config is inconsistent")
        if not 0 < self.num_experts <= MAX_EXPERTS:
            raise UnsupportedModelError(
                f"num_experts={self.num_experts} is not supported (1 to {MAX_EXPERTS})")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts "
                f"({self.num_experts})")
        if self.moe_intermediate_size <= 0:
            raise UnsupportedModelError("moe_intermediate_size must be positive")


def qwen3_config(hf: dict[str, Any], source: Path) -> Qwen3Config:
    """Qwen3Config of a Qwen3 or Qwen3-MoE config.json dict, refusing what cannot run."""
    if hf.get("attention_bias"):
        raise UnsupportedModelError(f"{source}: Qwen3 with attention_bias=true is not supported")
    if hf.get("use_sliding_window"):
        raise UnsupportedModelError(
            f"{source}: Qwen3 with use_sliding_window=true is not supported")
    if hf.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError(f"{source}: MoE with a shared expert is not supported")
    base = llama_config({**hf, "attention_bias": False, "sliding_window": None}, source)
    num_layers = base.num_layers
    arch = (hf.get("architectures") or ["Qwen3ForCausalLM"])[0]
    moe: dict[str, Any] = {}
    if arch == "Qwen3MoeForCausalLM":
        try:
            experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
            step = int(hf.get("decoder_sparse_step") or 1)
            only = {int(i) for i in hf.get("mlp_only_layers") or []}
            moe = {
                "num_experts": experts,
                "num_experts_per_tok": int(hf["num_experts_per_tok"]),
                "moe_intermediate_size": int(hf["moe_intermediate_size"]),
                "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
                "sparse_layers": tuple(experts > 0 and i not in only and (i + 1) % step == 0
                                       for i in range(num_layers)),
            }
        except (KeyError, TypeError, ValueError) as err:
            raise ModelLoadError(f"{source}: MoE config lacks or mistypes {err}") from err
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    return Qwen3Config(**(fields | moe))


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape of every tensor a Qwen3 (MoE) model reads; experts by the
    names Hugging Face checkpoints use (`mlp.experts.{e}.gate_proj.weight`)."""
    assert isinstance(config, Qwen3Config)
    shapes = llama_shapes(config)
    hidden, d = config.hidden_size, config.head_dim
    for i, sparse in enumerate(config.sparse_layers or (False,) * config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
        if not sparse:
            continue
        for n in ("gate", "up", "down"):
            del shapes[p + f"mlp.{n}_proj.weight"]
        inter = config.moe_intermediate_size
        shapes[p + "mlp.gate.weight"] = (config.num_experts, hidden)
        for e in range(config.num_experts):
            x = p + f"mlp.experts.{e}."
            shapes |= {x + "gate_proj.weight": (inter, hidden),
                       x + "up_proj.weight": (inter, hidden),
                       x + "down_proj.weight": (hidden, inter)}
    return shapes
