"""Llama-family decoder: Llama 2/3, SmolLM2, Mistral, Qwen2 (QKV bias).

Weights are kept as plain tensors, fused where it saves ops (QKV, gate/up), in the reference's
[out, in] layout: `F.linear` on it rounds like transformers does (an [in, out] copy streams
faster for one row but adds 2-3x the rounding, past the 1e-4 logit tolerance we hold).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstack.attention import AttentionMetadata, paged_attention
from kvstack.config import ModelConfig
from kvstack.errors import ModelLoadError
from kvstack.kv.storage import KVCacheStorage
from kvstack.models.registry import register
from kvstack.models.rope import RotaryEmbedding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Computed in fp32 whatever the model dtype, as the reference does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class _Layer:
    def __init__(self) -> None:
        self.input_norm: torch.Tensor
        self.post_norm: torch.Tensor
        self.w_qkv: torch.Tensor  # [(H + 2 H_kv) D, hidden]
        self.b_qkv: torch.Tensor | None
        self.w_o: torch.Tensor  # [hidden, H D]
        self.w_gate_up: torch.Tensor  # [2 I, hidden]
        self.w_down: torch.Tensor  # [hidden, I]


@register("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
class LlamaForCausalLM:
    """Forward over a flattened batch of new tokens, reading/writing the paged KV cache."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        self.config = config
        self.dtype = dtype
        self.rope = RotaryEmbedding(
            config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling
        )
        self.layers = [_Layer() for _ in range(config.num_layers)]
        self.embed: torch.Tensor
        self.final_norm: torch.Tensor
        self.lm_head: torch.Tensor  # [vocab, hidden]

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take HF-named tensors ([out, in] layout) and fuse them."""
        c = self.config

        def get(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ModelLoadError(f"checkpoint lacks tensor {name!r}; the file is incomplete")
            return tensors[name].to(self.dtype)

        self.embed = get("model.embed_tokens.weight").contiguous()
        self.final_norm = get("model.norm.weight")
        head = self.embed if c.tie_word_embeddings else get("lm_head.weight")
        self.lm_head = head
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer.input_norm = get(p + "input_layernorm.weight")
            layer.post_norm = get(p + "post_attention_layernorm.weight")
            qkv = [get(a + f"{n}_proj.weight") for n in "qkv"]
            layer.w_qkv = torch.cat(qkv, dim=0)
            layer.b_qkv = (
                torch.cat([get(a + f"{n}_proj.bias") for n in "qkv"])
                if c.attention_bias
                else None
            )
            layer.w_o = get(a + "o_proj.weight")
            gate_up = [get(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
            layer.w_gate_up = torch.cat(gate_up, dim=0)
            layer.w_down = get(p + "mlp.down_proj.weight")

    @property
    def num_weight_bytes(self) -> int:
        tensors = [self.embed, self.final_norm]
        if not self.config.tie_word_embeddings:
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVCacheStorage | None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] (after the final norm)."""
        c = self.config
        num_q, num_kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        eps = c.rms_norm_eps
        h = self.embed[input_ids]
        cos, sin = self.rope.table(positions, self.dtype)
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, eps)
            qkv = F.linear(x, layer.w_qkv, layer.b_qkv)
            q, k, v = qkv.split([num_q, num_kv, num_kv], dim=-1)
            q = q.view(-1, c.num_heads, c.head_dim)
            k = k.view(-1, c.num_kv_heads, c.head_dim)
            v = v.view(-1, c.num_kv_heads, c.head_dim)
            q, k = self.rope(q, k, cos, sin)
            attn = paged_attention(i, q, k, v, meta, kv)
            h = h + F.linear(attn.view(-1, num_q), layer.w_o)
            x = rms_norm(h, layer.post_norm, eps)
            gate, up = F.linear(x, layer.w_gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.w_down)
        return rms_norm(h, self.final_norm, eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (only the positions that sample) -> float32 logits [N, vocab]."""
        return F.linear(hidden, self.lm_head).float()
