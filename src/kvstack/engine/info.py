"""What an engine serves, as a value: the front ends (server, CLI, benchmarks, evaluations)
read this instead of reaching into the engine's parts."""

from __future__ import annotations

from dataclasses import dataclass

from kvstack.config import ModelConfig
from kvstack.kv.sizing import KVShape


@dataclass(frozen=True)
class ModelInfo:
    name: str  # as given: the embedded model's name, a file or a folder
    config: ModelConfig  # architecture hyper-parameters
    fingerprint: str  # sha256 naming weights, tokenizer, dtype, weight and KV format, attention
    dtype: str  # weights' and activations' dtype
    quantization: str | None  # weight-only quantization, if any
    kv_cache_dtype: str  # resolved (never "auto")
    num_weight_bytes: int  # weights as held (a tied head counts once)
    kv_shape: KVShape | None  # the arithmetic the pool was sized with; None: no KV cache
    num_kv_blocks: int  # blocks in the pool (0: no KV cache)
    kv_cache_bytes: int  # K/V storage allocated, scales and int4's window pool included
    kv_window: int | None = None  # window mode (approximate): tokens attended, sinks included
    kv_sink_tokens: int = 0

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def block_size(self) -> int:
        return self.kv_shape.block_size if self.kv_shape is not None else 0

    @property
    def unbounded_context(self) -> bool:
        """Window mode: positions are indices in the window, so no prompt is too long."""
        return self.kv_window is not None
