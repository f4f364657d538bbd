"""Gemma 3 text decoder over the paged KV cache (config mapping in `gemma3_config.py`).

Norms, QK-norm, RoPE and GELU run in PyTorch's ops. Attention goes through
`layers/attention.py` with each layer's own window (sliding layers: the 512 most recent
positions, exact as trained) and Gemma's score scale: decode rows take the C decode-attention
kernel when `use_kernels` (a window layer reads each row's last 512 slots), everything else
SDPA. The linear layers are built as Llama's are (`models/linears.py`): a `Linear` in the
model dtype or int8, or with `quantization="gguf"` a `GGUFLinear` on the file's own blocks
(q/k/v of different types, as the 270M's Q5_0 q/k and Q8_0 v, a `ConcatLinear`); decode-sized
products take the C kernels when `use_kernels`, PyTorch's matmul otherwise. A tied GGUF table
is the LM head and serves embedding lookups too (rows dequantized per token). A float32
model's steps of decodes only over a plain float32 cache run every layer in one C call
(`kernels/gemma_step.py`), which agrees with the per-op path to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch
import torch.nn.functional as F

from kvstack.config import ModelConfig
from kvstack.errors import UnsupportedModelError
from kvstack.kernels import ops as kernel_ops
from kvstack.kernels.decode_step import StepCaches
from kvstack.kernels.gemma_step import (
    GemmaDecodeStep,
    GemmaLayerWeights,
    GemmaOps,
    step_supported,
)
from kvstack.kernels.gguf import GGUFLinear
from kvstack.kernels.linear import prefill_attention_dtype
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.layers.attention import (
    AttentionMetadata,
    GroupedMetadata,
    LayerHook,
    StepMetadata,
    paged_attention,
    window_slots,
)
from kvstack.layers.rope import inv_frequencies
from kvstack.models.base import ModelFamily
from kvstack.models.embedding import embed_rows, embedding_nbytes
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
        self._step: GemmaDecodeStep | None = None
        self._step_for: tuple[int, tuple[int, ...]] | None = None  # (storage id, places)
        self._step_keep: KVCacheStorage | None = None  # the storage `_step` points into
        self._gemma_ops: GemmaOps | None = None

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
        # quantized weights' prefill attends in bf16 as its products do (engine/steps.py reads it)
        self.prefill_dtype = prefill_attention_dtype(self.dtype, (
            lin for ly in self.layers for lin in (ly.qkv, ly.o, ly.gate_up, ly.down)))

    @property
    def num_weight_bytes(self) -> int:
        """Bytes of the weights as held: GGUF blocks as the file's bytes, a tied head once."""
        total = self.lm_head.num_bytes + embedding_nbytes(self.embed, self.lm_head)
        for layer in self.layers:
            total += sum(lin.num_bytes for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
            total += 4 * (4 * self.config.hidden_size + 2 * self.config.head_dim)
        return total + 4 * self.config.hidden_size

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_rows(self.embed, self.lm_head, input_ids, self.dtype) * self.embed_scale

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
                kv_storage: KVCacheStorage | None,
                hook: LayerHook | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] (after the final norm);
        `hook` may keep only some rows after a layer's Q/K/V (`LayerHook`). Decode-sized
        float32 steps take the C loops (`kernels/gemma_step.py`), a step of decodes only all
        layers in one call; the rest PyTorch's ops."""
        c = self.config
        eps = c.rms_norm_eps
        h = self._embed(input_ids)
        c_ops = self._c_ops(input_ids.shape[0], meta, hook)
        if c_ops is not None and self._run_decode_step(h, positions, meta, kv_storage):
            return gemma_rms_norm(h, self.final_norm, eps)
        rope = {t: _cos_sin(positions, f, self.dtype) for t, f in self.inv_freq.items()}
        for i, layer in enumerate(self.layers):
            cos_sin = rope[c.layer_types[i]]
            if c_ops is not None:
                self._c_layer(c_ops, i, h, cos_sin, meta, kv_storage)
                continue
            x = gemma_rms_norm(h, layer.input_norm, eps)
            q, k, v = self._qkv(layer, x, cos_sin)
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

    def _c_ops(self, num_rows: int, meta: StepMetadata, hook: LayerHook | None
               ) -> GemmaOps | None:
        """The C loops for a decode-sized float32 step with kernels on; None: PyTorch's ops."""
        if (not self.use_kernels or self.dtype != torch.float32 or hook is not None
                or num_rows > self.lm_head.max_kernel_rows
                or _layer_metas(meta, len(self.layers)) is None
                or not kernel_ops.available(self.dtype)):
            return None
        if self._gemma_ops is None:
            self._gemma_ops = GemmaOps()
        return self._gemma_ops

    def _c_layer(self, ops: GemmaOps, i: int, h: torch.Tensor,
                 cos_sin: tuple[torch.Tensor, torch.Tensor], meta: StepMetadata,
                 kv_storage: KVCacheStorage | None) -> None:
        """Layer i on h [T, hidden] in place through the C loops, in the one-call step's
        order (gemma_step.c), so that a row gets the same bits either way."""
        c, layer = self.config, self.layers[i]
        eps, d, num_t = c.rms_norm_eps, c.head_dim, h.shape[0]
        qkv = layer.qkv(ops.norm(h, layer.input_norm, eps)).contiguous()
        cos, sin = (t.reshape(num_t, d).contiguous() for t in cos_sin)
        ops.qk_norm_rope_(qkv, c.num_heads, c.num_kv_heads, d, layer.q_norm, layer.k_norm, eps,
                          cos, sin)
        q, k, v = qkv.split([c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d], dim=-1)
        attn = paged_attention(i, q.unflatten(-1, (c.num_heads, d)),
                               k.unflatten(-1, (c.num_kv_heads, d)),
                               v.unflatten(-1, (c.num_kv_heads, d)), meta, kv_storage,
                               window=self.windows[i], scale=self.attn_scale)
        ops.add_norm_(h, layer.o(attn.reshape(num_t, -1).contiguous()), layer.post_attn_norm,
                      eps)
        gated = ops.gelu_mul(layer.gate_up(ops.norm(h, layer.pre_ffw_norm, eps)).contiguous())
        ops.add_norm_(h, layer.down(gated).contiguous(), layer.post_ffw_norm, eps)

    def _run_decode_step(self, h: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
                         kv_storage: KVCacheStorage | None) -> bool:
        """A step of decodes only, every layer in one C call (`kernels/gemma_step.py`), h
        turned in place into the last residual stream; False where the step does not apply
        (kernels off, not float32, a cache other than float32 / int8 / fp8, prefill rows)."""
        if kv_storage is None:
            return False
        metas = _layer_metas(meta, len(self.layers))
        if metas is None or not all(m.use_kernels and m.decodes_only(h.shape[0])
                                    for _, m in metas):
            return False
        step = self._decode_step(kv_storage, tuple(place for place, _ in metas))
        if step is None:
            return False
        views = []
        for (_, m), window in zip(metas, self.windows, strict=True):
            assert m.slot_mapping is not None and m.decode_slots is not None
            assert m.decode_lens is not None
            slots, lens = ((m.decode_slots, m.decode_lens) if window is None
                           else window_slots(m, window))
            views.append((m.slot_mapping, slots.contiguous(), lens.contiguous()))
        cos, sin = zip(*(_cos_sin(positions, self.inv_freq[t], self.dtype)
                         for t in (SLIDING, FULL)), strict=True)
        step(h, torch.stack(cos).squeeze(2).contiguous(),
             torch.stack(sin).squeeze(2).contiguous(), views)
        return True

    def _decode_step(self, kv_storage: KVCacheStorage, places: tuple[int, ...]
                     ) -> GemmaDecodeStep | None:
        """The one-call step over this storage and layer placement, built on first use; None
        where a cache is neither plain float32 nor int8 / fp8 codes, or a product has no
        kernel."""
        key = (id(kv_storage), places)
        if self._step_for != key:
            caches = _step_caches(kv_storage, places)
            layers = cast(Sequence[GemmaLayerWeights], self.layers)
            c = self.config
            self._step = GemmaDecodeStep(
                layers, caches, [t == FULL for t in c.layer_types], c.hidden_size, c.num_heads,
                c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps,
                c.head_dim**-0.5 if self.attn_scale is None else self.attn_scale,
            ) if caches is not None and step_supported(layers) else None
            self._step_for, self._step_keep = key, kv_storage
        return self._step

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


def _step_caches(kv_storage: KVCacheStorage, places: tuple[int, ...]) -> StepCaches | None:
    """Each layer's caches at its storage place as the one-call step reads them: plain float32
    (K, V), or int8 / fp8 codes and scales (in the Hadamard basis where the storage has one);
    None for anything else (a bfloat16 or int4 cache)."""
    plain = [kv_storage.layer_tensors(p) for p in places]
    if all(t is not None and t[0].dtype == torch.float32 for t in plain):
        return StepCaches([t for t in plain if t is not None])
    quantized = [kv_storage.quantized_tensors(p) for p in places]
    if all(t is not None for t in quantized):
        return StepCaches([t for t in quantized if t is not None], quantized=True,
                          rotate=kv_storage.basis is not None)
    return None


def _layer_metas(meta: StepMetadata, num_layers: int
                 ) -> list[tuple[int, AttentionMetadata]] | None:
    """Per layer, its storage place and its block tables' metadata (a hybrid layout's groups,
    or one table for all); None for the approximate window mode."""
    if isinstance(meta, GroupedMetadata):
        return meta.layers
    if isinstance(meta, AttentionMetadata):
        return [(i, meta) for i in range(num_layers)]
    return None


GEMMA3 = register(ModelFamily(
    name="gemma3",
    architectures=GEMMA3_ARCHITECTURES,
    create=Gemma3ForCausalLM,
    config_from_hf=gemma3_config,
    expected_shapes=expected_shapes,
    chat_template=GEMMA3_CHAT_TEMPLATE,
))
