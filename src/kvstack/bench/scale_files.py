"""Random-weight GGUF files of real model shapes (fewer layers where asked), for `bench scale`.

Speed needs no trained weights: each linear weight is random Q4_0 blocks (random 4-bit codes,
one fp16 scale giving a weight spread of about 0.02), norms are ones, the router is random
float32. Such a file runs exactly like a trained one of its shape and type (same bytes read,
same products); its outputs say nothing about quality. Writing the bytes directly (no float
tensor quantized) makes even a multi-GB file take seconds; files are cached under the kvstack
cache folder by shape and layer count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from kvstack.paths import cache_root

_Q4_0_BYTES = 18  # fp16 scale + 16 bytes of 4-bit codes per 32 weights
_SCALE = np.float16(0.02 / 4.6)  # codes 0..15 minus 8: std ~4.6 steps


@dataclass(frozen=True)
class Shape:
    """One model's layer shapes (Hugging Face names), as llama.cpp's arch writes them."""

    arch: str  # llama, qwen3, qwen3moe
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int  # dense MLP width (0: every layer is sparse)
    vocab: int
    layers: int  # the real model's
    tied: bool = True
    experts: int = 0
    top_k: int = 0
    expert_inter: int = 0


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 32, 8, 64, 8192, 128256, 16),
    "qwen3-4b": Shape("qwen3", 2560, 32, 8, 128, 9728, 151936, 36),
    "qwen3-30b-a3b": Shape("qwen3moe", 2048, 32, 4, 128, 0, 151936, 48, tied=False,
                           experts=128, top_k=8, expert_inter=768),
    # The MoE's attention with a dense MLP as wide as its 8 active experts together: the dense
    # model with the MoE's active parameter count.
    "qwen3-30b-a3b-active-dense": Shape("qwen3", 2048, 32, 4, 128, 8 * 768, 151936, 48,
                                        tied=False),
}


def scale_file(name: str, layers: int | None = None) -> Path:
    """The cached random GGUF of SHAPES[name] with `layers` layers (default: all), written
    on first use."""
    shape = SHAPES[name]
    num = layers or shape.layers
    path = cache_root() / "bench-scale" / f"{name}-{num}L-Q4_0.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_scale_file(partial, shape, num)
        partial.rename(path)
    return path


def _q4_0(rng: np.random.Generator, *dims: int) -> np.ndarray:
    """Random Q4_0 blocks of a weight [*outer, rows, cols] as bytes [*outer, rows, row bytes]."""
    *outer, cols = dims
    raw = rng.integers(0, 256, size=(*outer, cols // 32, _Q4_0_BYTES), dtype=np.uint8)
    raw[..., :2] = np.frombuffer(_SCALE.tobytes(), dtype=np.uint8)
    return raw.reshape(*outer, cols // 32 * _Q4_0_BYTES)


def write_scale_file(path: Path, s: Shape, layers: int,
                     extra: Mapping[str, gguf.ReaderField] | None = None) -> None:
    """A random Q4_0 GGUF of shape `s` with `layers` layers at `path`; `extra`: key-value
    fields copied from another file (e.g. its tokenizer)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, s.arch)
    _header(w, s, layers, extra or {})

    def q4(name: str, *dims: int) -> None:
        w.add_tensor(name, _q4_0(rng, *dims), raw_dtype=QType.Q4_0)

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    q4("token_embd.weight", s.vocab, s.hidden)
    ones("output_norm.weight", s.hidden)
    if not s.tied:
        q4("output.weight", s.vocab, s.hidden)
    q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for i in range(layers):
        b = f"blk.{i}."
        ones(b + "attn_norm.weight", s.hidden)
        ones(b + "ffn_norm.weight", s.hidden)
        q4(b + "attn_q.weight", q_rows, s.hidden)
        q4(b + "attn_k.weight", kv_rows, s.hidden)
        q4(b + "attn_v.weight", kv_rows, s.hidden)
        q4(b + "attn_output.weight", s.hidden, q_rows)
        if s.arch != "llama":
            ones(b + "attn_q_norm.weight", s.head_dim)
            ones(b + "attn_k_norm.weight", s.head_dim)
        if s.experts:
            w.add_tensor(b + "ffn_gate_inp.weight",
                         rng.normal(0, 0.02, (s.experts, s.hidden)).astype(np.float32))
            q4(b + "ffn_gate_exps.weight", s.experts, s.expert_inter, s.hidden)
            q4(b + "ffn_up_exps.weight", s.experts, s.expert_inter, s.hidden)
            q4(b + "ffn_down_exps.weight", s.experts, s.hidden, s.expert_inter)
        else:
            q4(b + "ffn_gate.weight", s.inter, s.hidden)
            q4(b + "ffn_up.weight", s.inter, s.hidden)
            q4(b + "ffn_down.weight", s.hidden, s.inter)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _header(w: gguf.GGUFWriter, s: Shape, layers: int,
            extra: Mapping[str, gguf.ReaderField]) -> None:
    """The key-value part: `extra` first, then the shape as llama.cpp reads it."""
    for name, field in extra.items():
        kind = field.types[0]
        w.add_key_value(name, field.contents(), kind,
                        sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.inter or s.expert_inter)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(s.vocab)
    if s.experts:
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.top_k)
        w.add_expert_feed_forward_length(s.expert_inter)
