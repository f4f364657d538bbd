"""Gemma 3 text decoder over the paged KV cache (config mapping in `gemma3_config.py`).

Norms, QK-norm, RoPE and GELU run in PyTorch's ops. Attention goes through
`layers/attention.py` with each layer's own window (sliding layers: the 512 most recent
positions, exact as trained) and Gemma's score scale: decode rows take the C decode-attention
kernel when `use_kernels` (a window layer reads each row's last 512 slots), everything else
SDPA. The linear layers are built as Llama's are (`models/linears.py`): a `Linear` in the
model dtype or int8, or with `quantization="gguf"` a `GGUFLinear` on the file's own blocks
(q/k/v of different types, as the 270M's Q5_0 q/k and Q8_0 v, a `ConcatLinear`); decode-sized
products take the C kernels when `use_kernels`, PyTorch's matmul otherwise. A tied GGUF table
is the LM head and serves embedding lookups too (rows dequantized per token). Llama's
one-call decode step (all layers in C) is not used: its norms and activation are Llama's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from kvstack.config import ModelConfig
from kvstack.errors import UnsupportedModelError
from kvstack.kernels.gguf import GGUFLinear
from kvstack.kernels.linear import Linear
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.layers.attention import LayerHook, StepMetadata, paged_attention
from kvstack.layers.rope import inv_frequencies
from kvstack.models.base import ModelFamily
from kvstack.models.gemma3_config import (
    FULL,
    GEMMA3_ARCHITECTURES,
    GEMMA3_CHAT_TEMPLATE,
    SLIDING,
    Gemma3Config,
    expected_shapes,
    gemma3_config,
)
from kvstack.models.linears import AnyLinear, LinearBuilder
from kvstack.models.registry import register


def gemma_rms_norm(x: torch.Tensor, one_plus_w: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalize and scale in float32, then cast (Llama casts before scaling).
    `one_plus_w` is 1 + the checkpoint's weight, in float32."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * one_plus_w).to(x.dtype)


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, D] for these positions, computed as transformers does (fp32, then cast);
    per step, not from a table: two 32k x 256 tables would cost 128 MB for little."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Layer:
    def __init__(self) -> None:
        self.input_norm: torch.Tensor  # 1 + w, fp32 [hidden]; likewise the other norms
        self.post_attn_norm: torch.Tensor
        self.pre_ffw_norm: torch.Tensor
        self.post_ffw_norm: torch.Tensor
        self.q_norm: torch.Tensor  # [head_dim]
        self.k_norm: torch.Tensor
        self.qkv: AnyLinear  # [(H + 2 H_kv) D, hidden]
        self.o: AnyLinear  # [hidden, H D]
        self.gate_up: AnyLinear  # [2 I, hidden]
        self.down: AnyLinear  # [hidden, I]


class Gemma3ForCausalLM:
    """Forward over a flattened batch of new tokens, reading/writing the paged KV cache."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, quantization: str | None = None,
                 use_kernels: bool = True) -> None:
        if not isinstance(config, Gemma3Config):
            raise UnsupportedModelError(f"{config.architecture} needs a Gemma 3 config")
        self.config: Gemma3Config = config
        self.dtype = dtype
        self.quantization = quantization
        self.use_kernels = use_kernels  # for the linear layers only (see the module's doc)
        self.windows = config.layer_windows()
        # None where it is SDPA's default (the 270M: 256 ** -0.5), so that path stays the same.
        self.attn_scale = (None if config.query_pre_attn_scalar == config.head_dim
                           else config.attn_scale)
        self.inv_freq = {t: inv_frequencies(config.head_dim, *config.rope(t))
                         for t in (SLIDING, FULL)}
        # sqrt(hidden) rounded to the model dtype first, as transformers does.
        self.embed_scale = torch.tensor(config.hidden_size**0.5).to(dtype)
        self.layers = [_Layer() for _ in range(config.num_layers)]
        # [vocab, hidden]; None: rows come from the int8 head; GGUF: rows dequantized
        self.embed: torch.Tensor | GGUFLinear | None
        self.final_norm: torch.Tensor
        self.lm_head: AnyLinear

    def load_weights(self, tensors: Mapping[str, torch.Tensor],
                     blocks: Mapping[str, GGUFLinear] | None = None) -> None:
        """HF-named tensors and GGUF blocks (`quantization="gguf"`); norms stored as w (HF)
        are kept as 1 + w in float32."""
        build = LinearBuilder(tensors, blocks or {}, self.dtype, self.quantization,
                              self.use_kernels)

        def norm(name: str) -> torch.Tensor:
            return 1.0 + build.tensor(name).float()

        self.embed, self.lm_head = build.embedding_and_head(self.config.tie_word_embeddings)
        self.final_norm = norm("model.norm.weight")
        for i, layer in enumerate(self.layers):
            p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            layer.input_norm = norm(p + "input_layernorm.weight")
            layer.post_attn_norm = norm(p + "post_attention_layernorm.weight")
            layer.pre_ffw_norm = norm(p + "pre_feedforward_layernorm.weight")
            layer.post_ffw_norm = norm(p + "post_feedforward_layernorm.weight")
            layer.q_norm = norm(a + "q_norm.weight")
            layer.k_norm = norm(a + "k_norm.weight")
            layer.qkv = build.fused([a + f"{n}_proj.weight" for n in "qkv"])
            layer.o = build.fused([a + "o_proj.weight"])
            layer.gate_up = build.fused([m + "gate_proj.weight", m + "up_proj.weight"])
            layer.down = build.fused([m + "down_proj.weight"])

    @property
    def num_weight_bytes(self) -> int:
        """Bytes of the weights as held: GGUF blocks as the file's bytes, a tied head once."""
        total = self.lm_head.num_bytes
        embed = self.embed
        if isinstance(embed, GGUFLinear) and embed is not self.lm_head:
            total += embed.num_bytes
        elif isinstance(embed, torch.Tensor) and embed is not getattr(self.lm_head, "weight",
                                                                       None):
            total += embed.numel() * embed.element_size()
        for layer in self.layers:
            total += sum(lin.num_bytes for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
            total += 4 * (4 * self.config.hidden_size + 2 * self.config.head_dim)
        return total + 4 * self.config.hidden_size

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, GGUFLinear):
            rows = self.embed.rows(input_ids, self.dtype)
        elif self.embed is not None:
            rows = self.embed[input_ids]
        else:
            head = self.lm_head
            assert isinstance(head, Linear) and head.scale is not None
            rows = (head.weight[input_ids].float() * head.scale[input_ids, None]).to(self.dtype)
        return rows * self.embed_scale

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
                kv_storage: KVCacheStorage | None,
                hook: LayerHook | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] (after the final norm);
        `hook` may keep only some rows after a layer's Q/K/V (`LayerHook`)."""
        c = self.config
        eps = c.rms_norm_eps
        h = self._embed(input_ids)
        rope = {t: _cos_sin(positions, f, self.dtype) for t, f in self.inv_freq.items()}
        for i, layer in enumerate(self.layers):
            x = gemma_rms_norm(h, layer.input_norm, eps)
            q, k, v = self._qkv(layer, x, rope[c.layer_types[i]])
            if hook is not None and (rows := hook.after_qkv(i, q, k, v, kv_storage)) is not None:
                h, q, k, v, meta = h[rows], q[rows], k[rows], v[rows], hook.meta
                rope = {t: (cos[rows], sin[rows]) for t, (cos, sin) in rope.items()}
            attn = paged_attention(i, q, k, v, meta, kv_storage, window=self.windows[i],
                                   scale=self.attn_scale).reshape(q.shape[0], -1)
            h = h + gemma_rms_norm(layer.o(attn), layer.post_attn_norm, eps)
            x = gemma_rms_norm(h, layer.pre_ffw_norm, eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            gated = F.gelu(gate, approximate="tanh") * up
            h = h + gemma_rms_norm(layer.down(gated), layer.post_ffw_norm, eps)
        h = gemma_rms_norm(h, self.final_norm, eps)
        return hook.finish(h) if hook is not None else h

    def _qkv(self, layer: _Layer, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> q [T, H, D], k and v [T, H_kv, D]. K is cached after its QK-norm
        and RoPE."""
        c = self.config
        d, num_t = c.head_dim, x.shape[0]
        q, k, v = layer.qkv(x).split(
            [c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d], dim=-1)
        q = gemma_rms_norm(q.reshape(num_t, c.num_heads, d), layer.q_norm, c.rms_norm_eps)
        k = gemma_rms_norm(k.reshape(num_t, c.num_kv_heads, d), layer.k_norm, c.rms_norm_eps)
        return _rotate(q, *cos_sin), _rotate(k, *cos_sin), v.reshape(num_t, c.num_kv_heads, d)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (only the rows that sample) -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()


GEMMA3 = register(ModelFamily(
    name="gemma3",
    architectures=GEMMA3_ARCHITECTURES,
    create=Gemma3ForCausalLM,
    config_from_hf=gemma3_config,
    expected_shapes=expected_shapes,
    chat_template=GEMMA3_CHAT_TEMPLATE,
))
