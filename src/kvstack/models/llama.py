"""Llama-family decoder: Llama 2/3, SmolLM2, Mistral, Qwen2 (QKV bias).

Weights are fused where it saves ops (QKV, gate/up) and kept in the reference's [out, in]
layout, each in a `Linear` in the model dtype (float32, bfloat16) or int8 weight-only:
decode-sized products go to the C kernels, which stream each weight once per step, prefill-sized
ones to PyTorch's matmul. `use_kernels=False` is the reference path: PyTorch ops only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstack.config import ModelConfig
from kvstack.errors import ModelLoadError
from kvstack.kernels import ops as kernel_ops
from kvstack.kernels.decode_step import DecodeStep
from kvstack.kernels.linear import Linear
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.layers.attention import AttentionMetadata, paged_attention
from kvstack.layers.rope import RotaryEmbedding
from kvstack.models.registry import register


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Computed in fp32 whatever the model dtype, as the reference does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class _Layer:
    def __init__(self) -> None:
        self.input_norm: torch.Tensor
        self.post_norm: torch.Tensor
        self.qkv: Linear  # [(H + 2 H_kv) D, hidden], with Qwen2's bias
        self.o: Linear  # [hidden, H D]
        self.gate_up: Linear  # [2 I, hidden]
        self.down: Linear  # [hidden, I]


@register("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
class LlamaForCausalLM:
    """Forward over a flattened batch of new tokens, reading/writing the paged KV cache."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, quantization: str | None = None,
                 use_kernels: bool = True) -> None:
        self.config = config
        self.dtype = dtype
        self.quantization = quantization  # "int8": linear weights (and the LM head) as int8
        self.use_kernels = use_kernels
        self._step: DecodeStep | None = None
        self._step_for: KVCacheStorage | None = None  # the storage `_step` points into
        self.rope = RotaryEmbedding(
            config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling
        )
        self.layers = [_Layer() for _ in range(config.num_layers)]
        self.embed: torch.Tensor | None  # [vocab, hidden]; None: rows come from the LM head
        self.final_norm: torch.Tensor
        self.lm_head: Linear  # [vocab, hidden]

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take HF-named tensors ([out, in] layout) and fuse them."""
        c = self.config

        def get(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ModelLoadError(f"checkpoint lacks tensor {name!r}; the file is incomplete")
            return tensors[name].to(self.dtype)

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
            return Linear(weight, bias, self.dtype, self.quantization, self.use_kernels)

        embed = get("model.embed_tokens.weight").contiguous()
        self.final_norm = get("model.norm.weight")
        head = embed if c.tie_word_embeddings else get("lm_head.weight")
        self.lm_head = linear(head)
        # A tied int8 head doubles as the embedding table (rows dequantized on lookup).
        tied_int8 = c.tie_word_embeddings and self.lm_head.scale is not None
        self.embed = None if tied_int8 else embed
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer.input_norm = get(p + "input_layernorm.weight")
            layer.post_norm = get(p + "post_attention_layernorm.weight")
            qkv = torch.cat([get(a + f"{n}_proj.weight") for n in "qkv"], dim=0)
            bias = (torch.cat([get(a + f"{n}_proj.bias") for n in "qkv"])
                    if c.attention_bias else None)
            layer.qkv = linear(qkv, bias)
            layer.o = linear(get(a + "o_proj.weight"))
            layer.gate_up = linear(
                torch.cat([get(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")], dim=0)
            )
            layer.down = linear(get(p + "mlp.down_proj.weight"))

    @property
    def num_weight_bytes(self) -> int:
        """Bytes of the weights as held (a tied head counts once)."""
        linears = [self.lm_head] + [
            lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        total = sum(lin.num_bytes for lin in linears) + _nbytes(self.final_norm)
        if self.embed is not None and self.embed is not self.lm_head.weight:
            total += _nbytes(self.embed)
        for layer in self.layers:
            total += _nbytes(layer.input_norm) + _nbytes(layer.post_norm)
        return total

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            return self.embed[input_ids]
        head = self.lm_head
        assert head.scale is not None
        return (head.weight[input_ids].float() * head.scale[input_ids, None]).to(self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVCacheStorage | None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] (after the final norm)."""
        if (self.use_kernels and input_ids.shape[0] <= self.lm_head.max_kernel_rows
                and meta.window is None
                and kernel_ops.available(self.dtype)):
            return self._forward_fused(input_ids, positions, meta, kv)
        c = self.config
        num_q, num_kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        eps = c.rms_norm_eps
        h = self._embed(input_ids)
        cos, sin = self.rope.table(positions, self.dtype)
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, eps)
            qkv = layer.qkv(x)
            q, k, v = qkv.split([num_q, num_kv, num_kv], dim=-1)
            q = q.view(-1, c.num_heads, c.head_dim)
            k = k.view(-1, c.num_kv_heads, c.head_dim)
            v = v.view(-1, c.num_kv_heads, c.head_dim)
            q, k = self.rope(q, k, cos, sin)
            attn = paged_attention(i, q, k, v, meta, kv)
            h = h + layer.o(attn.view(-1, num_q))
            x = rms_norm(h, layer.post_norm, eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        return rms_norm(h, self.final_norm, eps)

    def _forward_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVCacheStorage | None,
    ) -> torch.Tensor:
        """`forward` for decode-sized steps: the same math with the norms (each fused with the
        residual add before it), RoPE and SiLU-gate in C, one call each instead of 5-10 ops."""
        c = self.config
        num_q, num_kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        eps = c.rms_norm_eps
        h = self._embed(input_ids).contiguous()
        cos, sin = self.rope.cos[positions], self.rope.sin[positions]  # fp32 [T, D]
        step = self._decode_step(kv) if _decodes_only(meta, input_ids.shape[0]) else None
        if step is not None:
            assert meta.slot_mapping is not None and meta.decode_slots is not None
            assert meta.decode_lens is not None
            pending = step(h, cos, sin, meta.slot_mapping, meta.decode_slots, meta.decode_lens)
            return kernel_ops.rms_norm(h, self.final_norm, eps, residual=pending)
        pending: torch.Tensor | None = None  # the last block's output, added to h by the norm
        for i, layer in enumerate(self.layers):
            x = kernel_ops.rms_norm(h, layer.input_norm, eps, residual=pending)
            qkv = layer.qkv(x)
            kernel_ops.rope_(qkv, c.num_heads + c.num_kv_heads, c.head_dim, cos, sin)
            q, k, v = qkv.split([num_q, num_kv, num_kv], dim=-1)
            attn = paged_attention(i, q.view(-1, c.num_heads, c.head_dim),
                                   k.view(-1, c.num_kv_heads, c.head_dim),
                                   v.view(-1, c.num_kv_heads, c.head_dim), meta, kv)
            x = kernel_ops.rms_norm(h, layer.post_norm, eps, residual=layer.o(attn.view(-1, num_q)))
            pending = layer.down(kernel_ops.silu_mul(layer.gate_up(x)))
        return kernel_ops.rms_norm(h, self.final_norm, eps, residual=pending)

    def _decode_step(self, kv: KVCacheStorage | None) -> DecodeStep | None:
        """The one-call decode step over this storage, built on first use; None where the
        cache is lossy or a weight has no kernel."""
        if kv is None:
            return None
        if self._step_for is not kv:
            caches = [kv.layer_tensors(i) for i in range(self.config.num_layers)]
            linears = [lin for layer in self.layers
                       for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            usable = all(t is not None and t[0].dtype == self.dtype for t in caches) and all(
                lin.kernel is not None for lin in linears)
            c = self.config
            self._step = DecodeStep(
                self.layers, caches, self.dtype, c.hidden_size, c.num_heads, c.num_kv_heads,
                c.head_dim, c.intermediate_size, c.rms_norm_eps,
            ) if usable else None
            self._step_for = kv
        return self._step

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (only the positions that sample) -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()


def _decodes_only(meta: AttentionMetadata, num_rows: int) -> bool:
    """Every row of the step is one sequence's next token, in row order."""
    rows = meta.decode_rows
    return (rows is not None and not meta.prefills and rows.numel() == num_rows
            and meta.decode_lens is not None and meta.slot_mapping is not None)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
