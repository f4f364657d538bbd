"""Qwen3.5 text decoder: Gated DeltaNet layers and gated full-attention layers (config and the
differences from Qwen3 in `qwen3_5_config.py`; transformers' modeling_qwen3_5 is the reference).

The attention layers read and write the paged KV cache as every model does (KV layer index:
the attention layer's ordinal). The linear-attention layers (`layers/gated_delta.py`) keep a
state per sequence instead: the step's `StepStates` (set by the recurrent state store,
`recurrent/store.py`, before each step) gives each sequence's rows, its live states and the
offsets where the store wants a snapshot. Prefill spans run the chunked delta rule, lone
decode rows the recurrent step (batched). PyTorch ops only: no C decode kernel yet.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvstack.config import ModelConfig
from kvstack.errors import UnsupportedModelError
from kvstack.kernels.gguf import GGUFLinear
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.layers import gated_delta as gd
from kvstack.layers.attention import LayerHook, StepMetadata, paged_attention
from kvstack.layers.rope import RotaryEmbedding
from kvstack.models.base import ModelFamily
from kvstack.models.embedding import embedding_nbytes
from kvstack.models.embedding import tensor_nbytes as _nbytes
from kvstack.models.linears import AnyLinear, LinearBuilder
from kvstack.models.qwen3 import DenseMLP
from kvstack.models.qwen3_5_config import (
    FULL,
    QWEN3_5_ARCHITECTURES,
    Qwen3_5Config,
    expected_shapes,
    qwen3_5_config,
)
from kvstack.models.registry import register
from kvstack.recurrent.plan import LinearState, StepStates


def norm1p(x: torch.Tensor, weight1: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled by (1 + weight) (`weight1`, float32), computed in float32."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight1).to(x.dtype)


class _Layer:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.input_norm: torch.Tensor
        self.post_norm: torch.Tensor
        self.mixer_in: AnyLinear  # attention: q+gate, k, v; linear: qkv, z, b, a
        self.mixer_out: AnyLinear
        self.q_norm: torch.Tensor
        self.k_norm: torch.Tensor
        self.delta: gd.GatedDeltaWeights
        self.mlp: DenseMLP
        self.index = 0  # KV layer (attention) or state index (linear) among its kind


class Qwen3_5ForCausalLM:
    """Forward over a flattened batch of new tokens: paged KV for attention layers, the
    step's recurrent states for the linear ones."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, quantization: str | None = None,
                 use_kernels: bool = True) -> None:
        if not isinstance(config, Qwen3_5Config):
            raise UnsupportedModelError(f"{config.architecture} needs a Qwen3.5 config")
        if quantization is not None:
            raise UnsupportedModelError("Qwen3.5 runs unquantized weights only (no int8/gguf)")
        self.config: Qwen3_5Config = config
        self.dtype, self.quantization = dtype, quantization
        self.use_kernels = False  # no C kernels for these layers yet
        self.rope = RotaryEmbedding(config.rotary_dim, config.max_model_len, config.rope_theta,
                                    None)
        self.layers = [_Layer(kind) for kind in config.layer_types]
        counts = {FULL: 0, "linear_attention": 0}
        for layer in self.layers:
            layer.index = counts[layer.kind]
            counts[layer.kind] += 1
        self.step_states: StepStates | None = None  # set per step by the state store
        self.embed: torch.Tensor | GGUFLinear | None
        self.final_norm: torch.Tensor
        self.lm_head: AnyLinear

    def load_weights(self, tensors: Mapping[str, torch.Tensor],
                     blocks: Mapping[str, GGUFLinear] | None = None) -> None:
        c = self.config
        build = LinearBuilder(tensors, blocks or {}, self.dtype, None, False)
        one = lambda name: 1.0 + build.tensor(name).float()  # noqa: E731
        self.final_norm = one("model.norm.weight")
        self.embed, self.lm_head = build.embedding_and_head(c.tie_word_embeddings)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_norm = one(p + "input_layernorm.weight")
            layer.post_norm = one(p + "post_attention_layernorm.weight")
            m = p + "mlp."
            layer.mlp = DenseMLP(build.fused([m + "gate_proj.weight", m + "up_proj.weight"]),
                                 build.fused([m + "down_proj.weight"]))
            if layer.kind == FULL:
                a = p + "self_attn."
                layer.mixer_in = build.fused([a + f"{n}_proj.weight" for n in "qkv"])
                layer.mixer_out = build.fused([a + "o_proj.weight"])
                layer.q_norm, layer.k_norm = one(a + "q_norm.weight"), one(a + "k_norm.weight")
                continue
            a = p + "linear_attn."
            layer.mixer_in = build.fused([a + f"in_proj_{n}.weight" for n in ("qkv", "z", "b",
                                                                                "a")])
            layer.mixer_out = build.fused([a + "out_proj.weight"])
            layer.delta = gd.GatedDeltaWeights(
                build.tensor(a + "conv1d.weight")[:, 0], build.tensor(a + "A_log"),
                build.tensor(a + "dt_bias"), build.tensor(a + "norm.weight"),
                c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                c.rms_norm_eps)

    def new_states(self) -> list[LinearState]:
        c = self.config
        conv = (c.conv_channels, c.linear_conv_kernel_dim - 1)
        ssm = (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        return [LinearState(torch.zeros(conv, dtype=self.dtype),
                               torch.zeros(ssm, dtype=torch.float32))
                for _ in range(c.num_linear_layers)]

    @property
    def state_nbytes(self) -> int:
        return self.config.state_bytes(torch.empty(0, dtype=self.dtype).element_size())

    @property
    def num_weight_bytes(self) -> int:
        total = self.lm_head.num_bytes + _nbytes(self.final_norm)
        total += embedding_nbytes(self.embed, self.lm_head)
        for ly in self.layers:
            total += ly.mixer_in.num_bytes + ly.mixer_out.num_bytes + ly.mlp.num_bytes
        return total

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
                kv_storage: KVCacheStorage | None,
                hook: LayerHook | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] (after the final norm)."""
        if hook is not None:
            raise UnsupportedModelError("Qwen3.5 runs no layer hooks (blending)")
        steps = self.step_states
        if steps is None:
            raise RuntimeError("a Qwen3.5 step needs its recurrent states (StepStates)")
        assert isinstance(self.embed, torch.Tensor)
        h = self.embed[input_ids]
        cos, sin = self.rope.table(positions, self.dtype)
        eps = self.config.rms_norm_eps
        for layer in self.layers:
            x = norm1p(h, layer.input_norm, eps)
            if layer.kind == FULL:
                h = h + self._attention(layer, x, cos, sin, meta, kv_storage)
            else:
                h = h + self._linear(layer, x, steps)
            h = h + layer.mlp(norm1p(h, layer.post_norm, eps))
        return norm1p(h, self.final_norm, eps)

    def _attention(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: StepMetadata, kv_storage: KVCacheStorage | None) -> torch.Tensor:
        c = self.config
        t, d, hq, hk = x.shape[0], c.head_dim, c.num_heads, c.num_kv_heads
        qg, k, v = layer.mixer_in(x).split([2 * hq * d, hk * d, hk * d], dim=-1)
        qg = qg.reshape(t, hq, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(t, hq * d)
        q = norm1p(q, layer.q_norm, c.rms_norm_eps)
        k = norm1p(k.reshape(t, hk, d), layer.k_norm, c.rms_norm_eps)
        r = c.rotary_dim
        q_rot, k_rot = self.rope(q[..., :r], k[..., :r], cos, sin)
        q = torch.cat([q_rot, q[..., r:]], dim=-1).contiguous()
        k = torch.cat([k_rot, k[..., r:]], dim=-1).contiguous()
        out = paged_attention(layer.index, q, k, v.reshape(t, hk, d).contiguous(), meta,
                              kv_storage)
        return layer.mixer_out(out.reshape(t, hq * d) * torch.sigmoid(gate))

    def _linear(self, layer: _Layer, x: torch.Tensor, steps: StepStates) -> torch.Tensor:
        c, w, j = self.config, layer.delta, layer.index
        hv = c.linear_num_value_heads
        mixed, z, b, a = layer.mixer_in(x).split(
            [c.conv_channels, hv * c.linear_value_head_dim, hv, hv], dim=-1)
        out = torch.empty(x.shape[0], hv, c.linear_value_head_dim, dtype=torch.float32)
        decodes = [s for s in steps.sequences if s.end - s.start == 1 and not s.stops]
        if decodes:
            rows = torch.tensor([s.start for s in decodes], dtype=torch.int64)
            out[rows] = gd.decode(w, mixed[rows], a[rows], b[rows], [s.states[j] for s in decodes])
        for s in steps.sequences:
            if s.end - s.start == 1 and not s.stops:
                s.taken.append([])
                continue
            o, snaps = gd.span(w, mixed[s.start:s.end], a[s.start:s.end], b[s.start:s.end],
                               s.states[j], s.stops)
            out[s.start:s.end] = o
            s.taken.append(snaps)
        return layer.mixer_out(gd.gated_norm(w, out, z, self.dtype))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


QWEN3_5 = register(ModelFamily(
    name="qwen3_5",
    architectures=QWEN3_5_ARCHITECTURES,
    create=Qwen3_5ForCausalLM,
    config_from_hf=qwen3_5_config,
    expected_shapes=expected_shapes,
))
