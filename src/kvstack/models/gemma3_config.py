"""Gemma 3 text (Gemma3ForCausalLM): its config mapping, tensor checks and turn-format template.

What differs from the Llama family (transformers' modeling_gemma3 is the reference):
- every layer is `sliding_attention` (a query sees the `sliding_window` most recent positions,
  itself included) or `full_attention`; by default every sixth layer is full;
- the two layer types rotate with different RoPE bases (local 1e4, global 1e6, the global one
  optionally scaled);
- q and k are RMS-normed per head (QK-norm) before RoPE; scores are scaled by
  query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- RMSNorm multiplies by (1 + w) in float32 and casts after; four norms per layer;
- the MLP gates with GELU (tanh); embeddings are scaled by sqrt(hidden_size) rounded to the
  model dtype; the LM head is the embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.config import ModelConfig
from kvstack.errors import ModelLoadError, UnsupportedModelError

GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM",)
SLIDING = "sliding_attention"
FULL = "full_attention"

# transformers' Gemma3TextConfig defaults, used where a config.json leaves a key out.
_DEFAULT_GLOBAL_THETA = 1_000_000.0
_DEFAULT_LOCAL_THETA = 10_000.0
_DEFAULT_SLIDING_WINDOW = 4096
_DEFAULT_PATTERN = 6
_DEFAULT_QUERY_PRE_ATTN_SCALAR = 256.0

# Gemma 3's turn format (its instruction-tuned chat template, text only), for model files that
# carry no template. A system message is folded into the first user turn, as Gemma 3 does.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\n' }}"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    """Gemma 3 hyper-parameters: `rope_theta` / `rope_scaling` are the full-attention layers';
    the Gemma-only ones below."""

    layer_types: tuple[str, ...] = ()  # SLIDING or FULL, one per layer
    sliding_window: int = _DEFAULT_SLIDING_WINDOW  # keys a sliding query sees, itself included
    rope_local_theta: float = _DEFAULT_LOCAL_THETA  # RoPE base of the sliding layers (unscaled)
    query_pre_attn_scalar: float = _DEFAULT_QUERY_PRE_ATTN_SCALAR

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layer_types) != self.num_layers:
            raise ModelLoadError(
                f"layer_types lists {len(self.layer_types)} layers but the model has "
                f"{self.num_layers}; the config is inconsistent"
            )
        unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
        if unknown:
            raise UnsupportedModelError(
                f"layer type {unknown[0]!r} is not supported (use {SLIDING}, {FULL})"
            )
        if self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window must be positive, got {self.sliding_window}")

    @property
    def attn_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5

    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.sliding_window if t == SLIDING else None for t in self.layer_types)

    def rope(self, layer_type: str) -> tuple[float, dict[str, Any] | None]:
        """(base, scaling) of a layer type's RoPE."""
        if layer_type == SLIDING:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling


def gemma3_config(hf: dict[str, Any], source: Path) -> Gemma3Config:
    """From a Gemma3TextConfig-style dict: transformers 5's `rope_parameters` per layer type, or
    the older `rope_theta` + `rope_local_base_freq` + `rope_scaling`."""
    _check_supported(hf, source)
    try:
        num_layers = int(hf["num_hidden_layers"])
        num_heads = int(hf["num_attention_heads"])
        global_rope, local_theta = _rope_by_type(hf)
        eos = hf.get("eos_token_id")
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern")
                      or _DEFAULT_PATTERN)
        layer_types = hf.get("layer_types") or [
            SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)
        ]
        return Gemma3Config(
            architecture=GEMMA3_ARCHITECTURES[0],
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
            max_model_len=int(hf.get("max_position_embeddings", 131_072)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(global_rope.get("rope_theta", _DEFAULT_GLOBAL_THETA)),
            rope_scaling=_scaling(global_rope),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            attention_bias=False,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else
            ((eos,) if eos is not None else ()),
            layer_types=tuple(layer_types),
            sliding_window=int(hf.get("sliding_window") or _DEFAULT_SLIDING_WINDOW),
            rope_local_theta=local_theta,
            query_pre_attn_scalar=float(
                hf.get("query_pre_attn_scalar") or _DEFAULT_QUERY_PRE_ATTN_SCALAR
            ),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(
            f"{source}: Gemma 3 config lacks or mistypes {err}; the config is incomplete"
        ) from err


def _check_supported(hf: dict[str, Any], source: Path) -> None:
    """Refuse Gemma-family options this model does not implement (Gemma 3 uses none of them)."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    unsupported = [
        ("hidden_activation", act) if act != "gelu_pytorch_tanh" else None,
        *((key, hf[key]) for key in ("final_logit_softcapping", "attn_logit_softcapping")
          if hf.get(key) is not None),
        *((key, hf[key]) for key in ("attention_bias", "use_bidirectional_attention")
          if hf.get(key)),
    ]
    found = [u for u in unsupported if u is not None]
    if found:
        key, value = found[0]
        raise UnsupportedModelError(f"{source}: Gemma 3 with {key}={value!r} is not supported")


def _rope_by_type(hf: dict[str, Any]) -> tuple[dict[str, Any], float]:
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:  # transformers >= 5
        global_rope = dict(params.get(FULL) or {})
        local = params.get(SLIDING) or {}
        if _scaling(local) is not None:
            raise UnsupportedModelError(
                "Gemma 3 with scaled RoPE on its sliding layers is not supported"
            )
        return global_rope, float(local.get("rope_theta", _DEFAULT_LOCAL_THETA))
    global_rope = dict(hf.get("rope_scaling") or params or {})
    global_rope["rope_theta"] = float(
        hf.get("rope_theta") or params.get("rope_theta") or _DEFAULT_GLOBAL_THETA
    )
    return global_rope, float(hf.get("rope_local_base_freq") or _DEFAULT_LOCAL_THETA)


def _scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):  # what layers/rope.py computes; Gemma 3 uses linear
        raise UnsupportedModelError(f"Gemma 3 with rope scaling {kind!r} is not supported")
    return {k: v for k, v in rope.items() if k != "rope_theta"}


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape of every tensor Gemma3ForCausalLM reads."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    d = config.head_dim
    q_rows, kv_rows = config.num_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config.num_layers):
        layer = f"model.layers.{i}."
        attn, mlp = layer + "self_attn.", layer + "mlp."
        shapes |= {
            layer + "input_layernorm.weight": (hidden,),
            layer + "post_attention_layernorm.weight": (hidden,),
            layer + "pre_feedforward_layernorm.weight": (hidden,),
            layer + "post_feedforward_layernorm.weight": (hidden,),
            attn + "q_proj.weight": (q_rows, hidden),
            attn + "k_proj.weight": (kv_rows, hidden),
            attn + "v_proj.weight": (kv_rows, hidden),
            attn + "o_proj.weight": (hidden, q_rows),
            attn + "q_norm.weight": (d,),
            attn + "k_norm.weight": (d,),
            mlp + "gate_proj.weight": (inter, hidden),
            mlp + "up_proj.weight": (inter, hidden),
            mlp + "down_proj.weight": (hidden, inter),
        }
    return shapes
