"""Qwen3.5 text (Qwen3_5ForCausalLM): config mapping and tensor checks.

A hybrid: `layer_types` lists, per layer, `linear_attention` (Gated DeltaNet: no K/V, a fixed
recurrent state per sequence) or `full_attention` (gated attention: q_proj yields each head's
query and an output gate, QK-norm, RoPE on the first `partial_rotary_factor` of head_dim).
Every RMSNorm but the DeltaNet's gated one scales by (1 + weight). The engine's KV cache holds
the full-attention layers only, so `num_layers` here counts those (what the KV sizing and
storage read); `layer_types` is the whole stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.config import ModelConfig
from kvstack.errors import ModelLoadError, UnsupportedModelError
from kvstack.models.llama import llama_config

QWEN3_5_ARCHITECTURES = ("Qwen3_5ForCausalLM",)
LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class Qwen3_5Config(ModelConfig):
    layer_types: tuple[str, ...] = ()
    rotary_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if sum(t == FULL for t in self.layer_types) != self.num_layers:
            raise ModelLoadError("layer_types disagrees with the count of attention layers")
        if self.linear_num_value_heads % max(self.linear_num_key_heads, 1):
            raise UnsupportedModelError(
                f"linear_num_value_heads {self.linear_num_value_heads} must be a multiple of "
                f"linear_num_key_heads {self.linear_num_key_heads}")
        if self.linear_conv_kernel_dim < 2:
            raise UnsupportedModelError("linear_conv_kernel_dim below 2 is not supported")

    @property
    def conv_channels(self) -> int:
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def num_linear_layers(self) -> int:
        return len(self.layer_types) - self.num_layers

    def recurrent_state_bytes(self, itemsize: int) -> tuple[int, int]:
        return self.num_linear_layers, self.state_bytes(itemsize)

    def state_bytes(self, conv_itemsize: int) -> int:
        """One sequence's recurrent state over all linear layers (delta-rule state float32,
        conv tail in the model dtype)."""
        per_layer = (self.linear_num_value_heads * self.linear_key_head_dim
                     * self.linear_value_head_dim * 4
                     + self.conv_channels * (self.linear_conv_kernel_dim - 1) * conv_itemsize)
        return per_layer * self.num_linear_layers


def qwen3_5_config(hf: dict[str, Any], source: Path) -> Qwen3_5Config:
    """Qwen3_5Config of a Qwen3.5 text config.json dict, refusing what cannot run."""
    hf = hf.get("text_config", hf) if "text_config" in hf else hf
    if hf.get("attention_bias"):
        raise UnsupportedModelError(f"{source}: Qwen3.5 with attention_bias=true is not supported")
    types = tuple(hf.get("layer_types") or ())
    if len(types) != hf.get("num_hidden_layers") or set(types) - {LINEAR, FULL}:
        raise UnsupportedModelError(
            f"{source}: layer_types must list linear_attention / full_attention per layer")
    if FULL not in types:
        raise UnsupportedModelError(f"{source}: a Qwen3.5 model without attention layers")
    rope = dict(hf.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"{source}: rope_type {rope.get('rope_type')!r} is not "
                                    "supported (default)")
    flat = {**hf, "rope_theta": rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            "rope_scaling": None, "rope_parameters": None, "attention_bias": False,
            "sliding_window": None, "num_hidden_layers": types.count(FULL),
            "architectures": ["Qwen3_5ForCausalLM"]}
    base = llama_config(flat, source)
    try:
        extra = {
            "layer_types": types,
            "rotary_dim": int(base.head_dim * float(rope.get("partial_rotary_factor", 1.0))),
            **{k: int(hf[k]) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                       "linear_key_head_dim", "linear_value_head_dim",
                                       "linear_conv_kernel_dim")},
        }
    except (KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"{source}: Qwen3.5 config lacks or mistypes {err}") from err
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    return Qwen3_5Config(**(fields | extra))


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape of every tensor a Qwen3.5 text model reads."""
    assert isinstance(config, Qwen3_5Config)
    c = config
    hidden, inter, d = c.hidden_size, c.intermediate_size, c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, hidden),
                                          "model.norm.weight": (hidden,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)
    hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,),
                   p + "mlp.gate_proj.weight": (inter, hidden),
                   p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter)}
        if kind == FULL:
            a = p + "self_attn."
            shapes |= {a + "q_proj.weight": (2 * c.num_heads * d, hidden),
                       a + "k_proj.weight": (c.num_kv_heads * d, hidden),
                       a + "v_proj.weight": (c.num_kv_heads * d, hidden),
                       a + "o_proj.weight": (hidden, c.num_heads * d),
                       a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)}
            continue
        a = p + "linear_attn."
        shapes |= {a + "in_proj_qkv.weight": (c.conv_channels, hidden),
                   a + "in_proj_z.weight": (hv * dv, hidden),
                   a + "in_proj_b.weight": (hv, hidden), a + "in_proj_a.weight": (hv, hidden),
                   a + "conv1d.weight": (c.conv_channels, 1, c.linear_conv_kernel_dim),
                   a + "dt_bias": (hv,), a + "A_log": (hv,), a + "norm.weight": (dv,),
                   a + "out_proj.weight": (hidden, hv * dv)}
    return shapes
