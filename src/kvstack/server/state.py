"""What every route needs: the server's config and the per-app `ServerState` (the engine,
its tokenizer and limits, the tenants' keys, metrics), and the request-to-SamplingParams
mapping both APIs share."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request

from kvstack.blend.params import BlendSpec
from kvstack.errors import InvalidRequestError
from kvstack.sampling_params import SamplingParams
from kvstack.semantic.cache import SemanticCacheConfig
from kvstack.server.auth import KeyRing
from kvstack.server.context_limit import Api, context_overflow
from kvstack.server.engine_client import EngineClient
from kvstack.server.errors import ApiError
from kvstack.server.generation import Generation, OutputStream
from kvstack.server.metrics import ServerMetrics
from kvstack.server.protocol import ExtraSampling
from kvstack.server.semantic_api import Probe, SemanticService
from kvstack.ui.service import UiService

DEFAULT_MAX_BODY_BYTES = 4 * 1024**2

# Body fields both APIs carry under the same name, passed to SamplingParams as they are.
_SHARED_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                           "seed", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                           "include_stop_str_in_output", "prompt_lookup",
                           "suffix_drafts")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str | None = None  # the name clients must ask for; default: the engine's model
    max_waiting: int | None = None  # queued requests past this get 429
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies get 413
    cache_ttl_scale: float = 1.0  # multiplies cache_control TTLs ("5m", "1h"); tests shrink it
    semantic: SemanticCacheConfig | None = None  # None: no semantic cache
    ui: bool = True  # serve the live view of the cache at /ui
    responses_db: Path | None = None  # stored Responses in this SQLite file; None: in memory
    responses_pin_ttl_s: float = 300.0  # a stored conversation's blocks stay pinned this long

    def __post_init__(self) -> None:
        if self.max_waiting is not None and self.max_waiting < 1:
            raise InvalidRequestError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.max_body_bytes < 1:
            raise InvalidRequestError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if not self.cache_ttl_scale > 0:
            raise InvalidRequestError(
                f"cache_ttl_scale must be > 0, got {self.cache_ttl_scale}"
            )
        if not self.responses_pin_ttl_s >= 0:
            raise InvalidRequestError(
                f"responses_pin_ttl_s must be >= 0, got {self.responses_pin_ttl_s}")


class ServerState:
    """What every route needs: the engine, its tokenizer and limits, keys and metrics."""

    def __init__(self, engine: EngineClient, keys: KeyRing, config: ServerConfig) -> None:
        if engine.tokenizer is None:
            raise InvalidRequestError("the server needs a tokenizer; load the model with one")
        info = engine.info
        self.engine = engine
        self.info = info
        self.config = config
        self.model_name = config.model_name or info.name
        self.tokenizer = engine.tokenizer
        self.max_model_len = info.max_model_len
        self.pool_tokens = info.num_kv_blocks * info.block_size  # 0: no KV cache
        # Window mode (kv_window, approximate) has no context limit: positions are cache indices.
        self.unbounded_context = info.unbounded_context
        self.keys = keys
        self.metrics = ServerMetrics(engine)
        self.created = int(time.time())
        self.semantic: SemanticService | None = None  # set by create_app
        self.ui: UiService | None = None  # the live view, set by create_app

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")

    def max_tokens(self, requested: int | None, num_prompt_tokens: int,
                   default: int | None = None, api: Api = "chat") -> int | None:
        """Refuse a prompt or an output that cannot fit the context, in `api`'s words
        (server/context_limit.py); fill in a default, never shrink what was asked.

        Without a request or route default the output may use the rest of the context (and of
        the KV pool, so a lone request always fits). In window mode nothing is refused."""
        context = self.max_model_len
        if self.unbounded_context:
            return requested if requested is not None else (default or context)
        if requested is not None and requested >= 1 \
                and num_prompt_tokens + requested > context:
            raise context_overflow(api, num_prompt_tokens, requested, context)
        if num_prompt_tokens >= context:
            raise context_overflow(api, num_prompt_tokens, None, context)
        if requested is None:
            room = min(context, self.pool_tokens or context) - num_prompt_tokens
            return max(1, min(room, default if default is not None else room))
        return requested  # values below 1 are refused by SamplingParams, with its message

    def sampling_params(self, body: ExtraSampling, max_tokens: int | None,
                        **fields: Any) -> SamplingParams:
        """SamplingParams of a request body: the fields both APIs share, then the API's own
        (`fields`); unset (None) fields keep SamplingParams' defaults."""
        shared = {name: getattr(body, name, None) for name in _SHARED_SAMPLING_FIELDS}
        given = shared | fields | {"max_tokens": max_tokens}
        return SamplingParams(**{k: v for k, v in given.items() if v is not None})

    def start(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
              request_id: str, cache_salt: str | None, probe: Probe | None = None,
              blend: BlendSpec | None = None, snapshot_at: Sequence[int] = ()
              ) -> OutputStream:
        """The output stream of a request: the semantic cache's replay on a trust-mode hit,
        else a model run (with the hit's answer as a draft in verify mode)."""
        if probe is not None and probe.replays:
            return probe.replay(request_id, prompt_token_ids)
        draft = probe.draft(self.tokenizer) if probe is not None else None
        return Generation(self.engine, self.metrics, prompt_token_ids, sampling_params,
                          request_id, cache_salt, draft, blend, snapshot_at)


def server_state(request: Request) -> ServerState:
    return request.app.state.kvstack
