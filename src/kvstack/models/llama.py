"""Llama-family decoder: Llama 2/3, SmolLM2, Mistral, Qwen2 (QKV bias).

Weights are fused where it saves ops (QKV, gate/up) and kept in the reference's [out, in]
layout, each in a `Linear` in the model dtype (float32, bfloat16) or int8 weight-only, or a
`GGUFLinear` holding a GGUF file's quantized blocks (`models/linears.py` builds them):
decode-sized products go to the C kernels, which stream each weight once per step, prefill-sized
ones to PyTorch's matmul. `use_kernels=False` is the reference path: PyTorch ops only.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from kvstack.config import ModelConfig
from kvstack.errors import ModelLoadError, UnsupportedModelError
from kvstack.kernels import ops as kernel_ops
from kvstack.kernels.decode_step import DecodeStep, LayerWeights, StepCaches, runs_in_decode_step
from kvstack.kernels.gguf import GGUFLinear
from kvstack.kernels.linear import prefill_attention_dtype
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.layers.attention import AttentionMetadata, LayerHook, StepMetadata, paged_attention
from kvstack.layers.rope import RotaryEmbedding
from kvstack.models.base import ModelFamily
from kvstack.models.embedding import embed_rows, embedding_nbytes
from kvstack.models.embedding import tensor_nbytes as _nbytes
from kvstack.models.linears import AnyLinear, LinearBuilder
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
        self.qkv: AnyLinear  # [(H + 2 H_kv) D, hidden], with Qwen2's bias
        self.o: AnyLinear  # [hidden, H D]
        self.gate_up: AnyLinear  # [2 I, hidden]
        self.down: AnyLinear  # [hidden, I]


class LlamaForCausalLM:
    """Forward over a flattened batch of new tokens, reading/writing the paged KV cache."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, quantization: str | None = None,
                 use_kernels: bool = True) -> None:
        self.config = config
        self.dtype = dtype
        # "int8": linear weights (and the LM head) as int8; "gguf": as the file's blocks
        self.quantization = quantization
        self.use_kernels = use_kernels
        self._step: DecodeStep | None = None
        self._step_for: KVCacheStorage | None = None  # the storage `_step` points into
        self.rope = RotaryEmbedding(
            config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling
        )
        self.layers = [_Layer() for _ in range(config.num_layers)]
        # [vocab, hidden]; None: rows come from the int8 LM head; GGUF: rows dequantized
        self.embed: torch.Tensor | GGUFLinear | None
        self.final_norm: torch.Tensor
        self.lm_head: AnyLinear  # [vocab, hidden]

    def load_weights(self, tensors: Mapping[str, torch.Tensor],
                     blocks: Mapping[str, GGUFLinear] | None = None) -> None:
        """Take HF-named tensors ([out, in] layout) and GGUF blocks, and fuse them."""
        c = self.config
        build = LinearBuilder(tensors, blocks or {}, self.dtype, self.quantization,
                              self.use_kernels)
        get = build.tensor
        self.final_norm = get("model.norm.weight")
        self.embed, self.lm_head = build.embedding_and_head(c.tie_word_embeddings)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer.input_norm = get(p + "input_layernorm.weight")
            layer.post_norm = get(p + "post_attention_layernorm.weight")
            layer.qkv = build.fused([a + f"{n}_proj.weight" for n in "qkv"],
                                    [a + f"{n}_proj.bias" for n in "qkv"]
                                    if c.attention_bias else None)
            layer.o = build.fused([a + "o_proj.weight"])
            layer.gate_up = build.fused([p + f"mlp.{n}_proj.weight" for n in ("gate", "up")])
            layer.down = build.fused([p + "mlp.down_proj.weight"])
        self.prefill_dtype = prefill_attention_dtype(self.dtype, (  # engine/steps.py reads it
            lin for ly in self.layers for lin in (ly.qkv, ly.o, ly.gate_up, ly.down)))

    @property
    def num_weight_bytes(self) -> int:
        """Bytes of the weights as held (a tied head counts once)."""
        linears = [self.lm_head] + [
            lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        total = sum(lin.num_bytes for lin in linears) + _nbytes(self.final_norm)
        total += embedding_nbytes(self.embed, self.lm_head)
        for layer in self.layers:
            total += _nbytes(layer.input_norm) + _nbytes(layer.post_norm)
        return total

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_rows(self.embed, self.lm_head, input_ids, self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: StepMetadata,
        kv_storage: KVCacheStorage | None,
        hook: LayerHook | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] (after the final norm).

        Decode-sized steps take the C kernels (norms fused with the residual add before them,
        RoPE and SiLU-gate one call each; a step of decodes only runs every layer in one C
        call); larger steps and `use_kernels=False` take PyTorch's ops. Both run the same
        layer loop (`_layers`) with their own `_Ops`.
        """
        h = self._embed(input_ids)
        if (self.use_kernels and input_ids.shape[0] <= self.lm_head.max_kernel_rows
                and isinstance(meta, AttentionMetadata) and hook is None
                and kernel_ops.available(self.dtype)):
            h = h.contiguous()
            cos, sin = self.rope.cos[positions], self.rope.sin[positions]  # fp32 [T, D]
            step = self._decode_step(kv_storage) if meta.decodes_only(h.shape[0]) else None
            if step is not None:
                assert meta.slot_mapping is not None and meta.decode_slots is not None
                assert meta.decode_lens is not None
                pending = step(h, cos, sin, meta.slot_mapping, meta.decode_slots,
                               meta.decode_lens)
                return kernel_ops.rms_norm(h, self.final_norm, self.config.rms_norm_eps,
                                           residual=pending)
            return self._layers(h, _KernelOps(self.config, cos, sin), meta, kv_storage, hook)
        cos, sin = self.rope.table(positions, self.dtype)
        return self._layers(h, _TorchOps(self.config, self.rope, cos, sin), meta, kv_storage,
                            hook)

    def _layers(self, h: torch.Tensor, ops: _Ops, meta: StepMetadata,
                kv_storage: KVCacheStorage | None, hook: LayerHook | None) -> torch.Tensor:
        """The decoder layers over the residual stream h [T, hidden] (updated in place);
        `hook` may keep only some rows after a layer's Q/K/V (`LayerHook`)."""
        c = self.config
        num_q = c.num_heads * c.head_dim
        pending: torch.Tensor | None = None  # the last block's output, added to h by the norm
        for i, layer in enumerate(self.layers):
            x = ops.add_rms_norm(h, layer.input_norm, pending)
            q, k, v = ops.qkv_rope(layer.qkv(x))
            if hook is not None and (rows := hook.after_qkv(i, q, k, v, kv_storage)) is not None:
                h, q, k, v = h[rows], q[rows], k[rows], v[rows]
                meta, ops = hook.meta, ops.take(rows)
            attn = paged_attention(i, q, k, v, meta, kv_storage)
            x = ops.add_rms_norm(h, layer.post_norm, layer.o(attn.view(-1, num_q)))
            pending = layer.down(ops.silu_mul(layer.gate_up(x)))
        h = ops.add_rms_norm(h, self.final_norm, pending)
        return hook.finish(h) if hook is not None else h

    def _decode_step(self, kv_storage: KVCacheStorage | None) -> DecodeStep | None:
        """The one-call decode step over this storage, built on first use; None where the
        cache has no kernel (a cast float cache, int4) or a weight has none (kernels off, or
        unfused GGUF parts)."""
        if kv_storage is None:
            return None
        if self._step_for is not kv_storage:
            caches = StepCaches.of(kv_storage, self.config.num_layers, self.dtype)
            linears = [lin for layer in self.layers
                       for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            usable = all(runs_in_decode_step(lin) for lin in linears)
            c = self.config
            self._step = DecodeStep(  # usable: each linear a Linear/GGUFLinear (LayerWeights)
                cast(list[LayerWeights], self.layers), caches, self.dtype, c.hidden_size,
                c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps,
            ) if caches is not None and usable else None
            self._step_for = kv_storage
        return self._step

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (only the positions that sample) -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()


class _Ops:
    """The per-layer operations of one forward, on the residual stream h [T, hidden]."""

    def add_rms_norm(self, h: torch.Tensor, weight: torch.Tensor,
                     residual: torch.Tensor | None) -> torch.Tensor:
        """h += residual (in place, when given); return rms_norm(h) * weight."""
        raise NotImplementedError

    def qkv_rope(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A fused QKV projection [T, (H + 2 H_kv) D] -> q [T, H, D], k, v [T, H_kv, D],
        q and k rotated."""
        raise NotImplementedError

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 I] -> silu(gate) * up, [T, I]."""
        raise NotImplementedError

    def take(self, rows: torch.Tensor) -> _Ops:
        """These ops for a subset of the rows (a layer hook kept only them; torch path only)."""
        raise NotImplementedError


class _TorchOps(_Ops):
    """PyTorch ops in the model dtype (norms in fp32): the reference path."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, cos: torch.Tensor,
                 sin: torch.Tensor) -> None:
        self.c, self.rope, self.cos, self.sin = config, rope, cos, sin

    def add_rms_norm(self, h: torch.Tensor, weight: torch.Tensor,
                     residual: torch.Tensor | None) -> torch.Tensor:
        if residual is not None:
            h.add_(residual)
        return rms_norm(h, weight, self.c.rms_norm_eps)

    def qkv_rope(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.c
        num_q, num_kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = qkv.split([num_q, num_kv, num_kv], dim=-1)
        q, k = self.rope(q.view(-1, c.num_heads, c.head_dim),
                         k.view(-1, c.num_kv_heads, c.head_dim), self.cos, self.sin)
        return q, k, v.view(-1, c.num_kv_heads, c.head_dim)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def take(self, rows: torch.Tensor) -> _Ops:
        return _TorchOps(self.c, self.rope, self.cos[rows], self.sin[rows])


class _KernelOps(_Ops):
    """The C kernels (`kernels/ops.c`): the same math, one call per op; cos, sin fp32 [T, D]."""

    def __init__(self, config: ModelConfig, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.c, self.cos, self.sin = config, cos, sin

    def add_rms_norm(self, h: torch.Tensor, weight: torch.Tensor,
                     residual: torch.Tensor | None) -> torch.Tensor:
        return kernel_ops.rms_norm(h, weight, self.c.rms_norm_eps, residual=residual)

    def qkv_rope(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.c
        num_q, num_kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        kernel_ops.rope_(qkv, c.num_heads + c.num_kv_heads, c.head_dim, self.cos, self.sin)
        q, k, v = qkv.split([num_q, num_kv, num_kv], dim=-1)
        return (q.view(-1, c.num_heads, c.head_dim), k.view(-1, c.num_kv_heads, c.head_dim),
                v.view(-1, c.num_kv_heads, c.head_dim))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return kernel_ops.silu_mul(gate_up)


# -- the family: config mapping and tensor checks ---------------------------------------------

_MODEL_TYPE_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def llama_config(hf_config: dict[str, Any], source: Path) -> ModelConfig:
    """ModelConfig of a Llama-family config.json dict, refusing what this model can't run."""
    if hf_config.get("hidden_act", "silu") != "silu" or hf_config.get("mlp_bias"):
        raise UnsupportedModelError(
            f"{source}: only SiLU MLPs without bias are supported "
            f"(hidden_act={hf_config.get('hidden_act')}, mlp_bias={hf_config.get('mlp_bias')})"
        )
    hf = dict(hf_config)
    window = _sliding_window(hf)
    if window is not None and window < hf.get("max_position_embeddings", window + 1):
        # Attention is full, so it is exact only while the context fits in the window.
        hf["max_position_embeddings"] = window
    try:
        return _from_hf(hf)
    except (KeyError, TypeError) as err:
        raise ModelLoadError(
            f"{source}: model config lacks or mistypes {err}; the config is not a Llama-family one"
        ) from err


def _from_hf(hf: dict[str, Any]) -> ModelConfig:
    model_type = hf.get("model_type", "unknown")
    archs = hf.get("architectures") or [_MODEL_TYPE_ARCH.get(model_type, model_type)]
    num_heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelConfig(
        architecture=archs[0],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        max_model_len=hf.get("max_position_embeddings", 2048),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(hf),
        rope_scaling=_rope_scaling(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _sliding_window(hf: dict[str, Any]) -> int | None:
    if hf.get("model_type") == "qwen2" and not hf.get("use_sliding_window"):
        return None
    return hf.get("sliding_window")


def _rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    # transformers >= 5 moved rope_scaling into rope_parameters with rope_type "default".
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    return dict(scaling)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape of every tensor the Llama-family model reads."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
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
            attn + "q_proj.weight": (q_rows, hidden),
            attn + "k_proj.weight": (kv_rows, hidden),
            attn + "v_proj.weight": (kv_rows, hidden),
            attn + "o_proj.weight": (hidden, q_rows),
            mlp + "gate_proj.weight": (inter, hidden),
            mlp + "up_proj.weight": (inter, hidden),
            mlp + "down_proj.weight": (hidden, inter),
        }
        if config.attention_bias:
            shapes |= {
                attn + "q_proj.bias": (q_rows,),
                attn + "k_proj.bias": (kv_rows,),
                attn + "v_proj.bias": (kv_rows,),
            }
    return shapes


LLAMA = register(ModelFamily(
    name="llama",
    architectures=tuple(_MODEL_TYPE_ARCH.values()),
    create=LlamaForCausalLM,
    config_from_hf=llama_config,
    expected_shapes=expected_shapes,
))
