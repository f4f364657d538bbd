"""What the HTTP layer needs of an engine, and nothing more.

One engine in this process (`AsyncLLM`) or many replicas behind a router (the cluster's client,
`kvstack.cluster.client.ClusterEngine`) serve the same routes: the response lifecycle, auth,
tenants, prompt caching, the semantic cache and usage shapes only ever call this interface.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

from kvstack.blend.params import BlendSpec
from kvstack.engine.info import ModelInfo
from kvstack.engine.stats import EngineStats
from kvstack.outputs import RequestOutput
from kvstack.sampling_params import SamplingParams


class EngineClient(Protocol):
    @property
    def info(self) -> ModelInfo:
        """The model served (every replica serves the same one)."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (transformers'), or None for a token-ids-only engine."""
        ...

    @property
    def errored(self) -> bool:
        """True once the engine can serve nothing more (the server should be restarted)."""
        ...

    def generate(self, prompt: str | Sequence[int], sampling_params: SamplingParams,
                 request_id: str, cache_salt: str | None = None,
                 draft_token_ids: Sequence[int] | None = None, blend: BlendSpec | None = None,
                 snapshot_at: Sequence[int] = ()) -> AsyncIterator[RequestOutput]:
        """Queue a request and stream its cumulative outputs; leaving early aborts it.
        `blend`: reuse its chunks' K/V (APPROXIMATE, `blend/`); `snapshot_at`: prompt lengths
        (cache breakpoints) a hybrid model keeps its recurrent state at (`recurrent/`)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def pin_prefix(self, token_ids: Sequence[int], cache_salt: str | None,
                         ttl_s: float) -> tuple[int, int]:
        """Pin the cached full blocks of this prefix for `ttl_s` seconds: (tokens newly
        pinned, tokens already pinned)."""
        ...

    def stats(self) -> EngineStats:
        """Counters summed over every replica."""
        ...

    def shutdown(self) -> None: ...


@runtime_checkable
class ReplicatedEngine(Protocol):
    """An engine client over several replicas: /metrics labels each one's figures."""

    def replica_stats(self) -> dict[str, EngineStats]:
        """The latest counters of each live replica, by replica name."""
        ...


@runtime_checkable
class EmbeddingEngine(Protocol):
    """An engine client that can pool the model's hidden states (one engine in this process):
    /v1/embeddings needs it and answers 501 without."""

    async def embed(self, token_ids: Sequence[int]) -> list[float]:
        """The L2-normalized mean of the final hidden states over `token_ids`
        (`engine/embedding.py`)."""
        ...
