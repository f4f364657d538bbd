"""Qwen3 and Qwen3-MoE decoders over the paged KV cache (config mapping in `qwen3_config.py`).

A Llama-family layer with QK-norm (q and k RMS-normed per head before RoPE); a MoE model's
sparse layers replace the MLP with `layers/moe.py`'s block (each chosen expert run once per
step on the rows that chose it). Linear layers are built as Llama's are (`models/linears.py`):
a `Linear` in the model dtype or int8, or a `GGUFLinear` on the file's blocks (an expert's
weights: its slice of the 3-D expert tensor). Decode-sized steps run the norms, RoPE and the
SiLU gate through the C ops (`kernels/ops.py`) and the products through the linears' kernels;
larger steps and `use_kernels=False` take PyTorch's ops. The Llama one-call decode step has
no QK-norm, so it is not used here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvstack.config import ModelConfig
from kvstack.errors import UnsupportedModelError
from kvstack.kernels import ops as kernel_ops
from kvstack.kernels.gguf import GGUFLinear
from kvstack.kernels.linear import prefill_attention_dtype
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.layers.attention import AttentionMetadata, LayerHook, StepMetadata, paged_attention
from kvstack.layers.moe import SparseMoE, silu_mul
from kvstack.layers.rope import RotaryEmbedding
from kvstack.models.base import ModelFamily
from kvstack.models.embedding import embed_rows, embedding_nbytes
from kvstack.models.embedding import tensor_nbytes as _nbytes
from kvstack.models.linears import AnyLinear, LinearBuilder
from kvstack.models.llama import rms_norm
from kvstack.models.qwen3_config import (
    QWEN3_ARCHITECTURES,
    Qwen3Config,
    expected_shapes,
    qwen3_config,
)
from kvstack.models.registry import register


class DenseMLP:
    """SiLU-gated MLP: down(silu(gate) * up), gate/up fused."""

    def __init__(self, gate_up: AnyLinear, down: AnyLinear) -> None:
        self.gate_up, self.down = gate_up, down

    @property
    def num_bytes(self) -> int:
        return self.gate_up.num_bytes + self.down.num_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(silu_mul(self.gate_up(x)))


class _Layer:
    def __init__(self) -> None:
        self.input_norm: torch.Tensor
        self.post_norm: torch.Tensor
        self.q_norm: torch.Tensor  # [head_dim]
        self.k_norm: torch.Tensor
        self.qkv: AnyLinear  # [(H + 2 H_kv) D, hidden]
        self.o: AnyLinear  # [hidden, H D]
        self.mlp: DenseMLP | SparseMoE


class Qwen3ForCausalLM:
    """Forward over a flattened batch of new tokens, reading/writing the paged KV cache."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, quantization: str | None = None,
                 use_kernels: bool = True) -> None:
        if not isinstance(config, Qwen3Config):
            raise UnsupportedModelError(f"{config.architecture} needs a Qwen3 config")
        self.config: Qwen3Config = config
        self.dtype = dtype
        self.quantization = quantization
        self.use_kernels = use_kernels
        self.rope = RotaryEmbedding(config.head_dim, config.max_model_len, config.rope_theta,
                                    config.rope_scaling)
        self.layers = [_Layer() for _ in range(config.num_layers)]
        self.embed: torch.Tensor | GGUFLinear | None
        self.final_norm: torch.Tensor
        self.lm_head: AnyLinear

    def load_weights(self, tensors: Mapping[str, torch.Tensor],
                     blocks: Mapping[str, GGUFLinear] | None = None) -> None:
        """HF-named tensors ([out, in]) and GGUF blocks, experts by their per-expert names."""
        c = self.config
        build = LinearBuilder(tensors, blocks or {}, self.dtype, self.quantization,
                              self.use_kernels)
        get = build.tensor
        self.final_norm = get("model.norm.weight")
        self.embed, self.lm_head = build.embedding_and_head(c.tie_word_embeddings)
        sparse = c.sparse_layers or (False,) * c.num_layers
        for i, layer in enumerate(self.layers):
            p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            layer.input_norm = get(p + "input_layernorm.weight")
            layer.post_norm = get(p + "post_attention_layernorm.weight")
            layer.q_norm = get(a + "q_norm.weight")
            layer.k_norm = get(a + "k_norm.weight")
            layer.qkv = build.fused([a + f"{n}_proj.weight" for n in "qkv"])
            layer.o = build.fused([a + "o_proj.weight"])
            if sparse[i]:
                experts = [(build.fused([m + f"experts.{e}.gate_proj.weight",
                                         m + f"experts.{e}.up_proj.weight"]),
                            build.fused([m + f"experts.{e}.down_proj.weight"]))
                           for e in range(c.num_experts)]
                layer.mlp = SparseMoE(get(m + "gate.weight"), experts, c.num_experts_per_tok,
                                      c.norm_topk_prob)
            else:
                layer.mlp = DenseMLP(build.fused([m + "gate_proj.weight", m + "up_proj.weight"]),
                                     build.fused([m + "down_proj.weight"]))
        self.prefill_dtype = prefill_attention_dtype(self.dtype, self._linears())

    def _linears(self) -> list[AnyLinear]:
        out: list[AnyLinear] = []
        for ly in self.layers:
            out += [ly.qkv, ly.o]
            if isinstance(ly.mlp, DenseMLP):
                out += [ly.mlp.gate_up, ly.mlp.down]
        return out

    @property
    def num_weight_bytes(self) -> int:
        """Bytes of the weights as held (a tied head counts once; every expert)."""
        total = self.lm_head.num_bytes + _nbytes(self.final_norm)
        total += embedding_nbytes(self.embed, self.lm_head)
        for ly in self.layers:
            total += ly.qkv.num_bytes + ly.o.num_bytes + ly.mlp.num_bytes
            total += sum(_nbytes(t) for t in (ly.input_norm, ly.post_norm, ly.q_norm, ly.k_norm))
        return total

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_rows(self.embed, self.lm_head, input_ids, self.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
                kv_storage: KVCacheStorage | None,
                hook: LayerHook | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] (after the final norm)."""
        h = self._embed(input_ids).contiguous()
        kernels = (self.use_kernels and input_ids.shape[0] <= self.lm_head.max_kernel_rows
                   and isinstance(meta, AttentionMetadata) and hook is None
                   and kernel_ops.available(self.dtype))
        if kernels:
            cos, sin = self.rope.cos[positions], self.rope.sin[positions]  # fp32 [T, D]
        else:
            cos, sin = self.rope.table(positions, self.dtype)
        c = self.config
        num_q = c.num_heads * c.head_dim
        pending: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            x = self._norm(h, layer.input_norm, pending, kernels)
            q, k, v = (self._qkv_kernels(layer, x, cos, sin) if kernels
                       else self._qkv_torch(layer, x, cos, sin))
            if hook is not None and (rows := hook.after_qkv(i, q, k, v, kv_storage)) is not None:
                h, q, k, v, meta = h[rows], q[rows], k[rows], v[rows], hook.meta
                cos, sin = cos[rows], sin[rows]
            attn = paged_attention(i, q, k, v, meta, kv_storage)
            x = self._norm(h, layer.post_norm, layer.o(attn.reshape(-1, num_q)), kernels)
            pending = layer.mlp(x)
        h = self._norm(h, self.final_norm, pending, kernels)
        return hook.finish(h) if hook is not None else h

    def _norm(self, h: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None,
              kernels: bool) -> torch.Tensor:
        """h += residual (in place, when given); return rms_norm(h) * weight."""
        eps = self.config.rms_norm_eps
        if kernels:
            return kernel_ops.rms_norm(h, weight, eps,
                                       residual=None if residual is None
                                       else residual.contiguous())
        if residual is not None:
            h.add_(residual)
        return rms_norm(h, weight, eps)

    def _qkv_torch(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        d, t = c.head_dim, x.shape[0]
        q, k, v = layer.qkv(x).split([c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d],
                                     dim=-1)
        q = rms_norm(q.reshape(t, c.num_heads, d), layer.q_norm, c.rms_norm_eps)
        k = rms_norm(k.reshape(t, c.num_kv_heads, d), layer.k_norm, c.rms_norm_eps)
        q, k = self.rope(q, k, cos, sin)
        return q, k, v.reshape(t, c.num_kv_heads, d)

    def _qkv_kernels(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The same through the C ops: per-head norms on a copy, written back, then RoPE over
        the q and k heads of the fused row in place."""
        c = self.config
        d, t, eps = c.head_dim, x.shape[0], c.rms_norm_eps
        num_q, num_kv = c.num_heads * d, c.num_kv_heads * d
        qkv = layer.qkv(x).contiguous()
        qkv[:, :num_q] = kernel_ops.rms_norm(qkv[:, :num_q].reshape(-1, d).contiguous(),
                                             layer.q_norm, eps).view(t, num_q)
        qkv[:, num_q:num_q + num_kv] = kernel_ops.rms_norm(
            qkv[:, num_q:num_q + num_kv].reshape(-1, d).contiguous(), layer.k_norm,
            eps).view(t, num_kv)
        kernel_ops.rope_(qkv, c.num_heads + c.num_kv_heads, d, cos, sin)
        q, k, v = qkv.split([num_q, num_kv, num_kv], dim=-1)
        return (q.view(t, c.num_heads, d), k.view(t, c.num_kv_heads, d),
                v.view(t, c.num_kv_heads, d))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (only the rows that sample) -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()


QWEN3 = register(ModelFamily(
    name="qwen3",
    architectures=QWEN3_ARCHITECTURES,
    create=Qwen3ForCausalLM,
    config_from_hf=qwen3_config,
    expected_shapes=expected_shapes,
))
