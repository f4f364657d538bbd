"""The semantic cache at the HTTP edge: which requests may use it and in which scope, playing
a hit back in each API's shape, storing finished answers, metrics, and the admin routes.

A request may hit or be stored only if it is deterministic (temperature 0, or top_k 1) unless
its body opts in with `"semantic_cache": true`; `"semantic_cache": false` opts out. Its key
text is the last user message (a completion's prompt); everything else that shapes the answer
— tenant, model fingerprint, API, system prompt, the turns around the key text, the sampling
parameters as requested, the cache salt — is hashed into its scope, so any difference there
never hits. Responses of a request that looked up carry `x-kvstack-semantic-cache: hit|miss`
and `usage.semantic_cache_hit`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from typing import Any

from fastapi import APIRouter, Query, Request
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstack.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvstack.sampling_params import SamplingParams
from kvstack.semantic.cache import Lookup, SemanticCache, SemanticCacheConfig
from kvstack.semantic.entry import Answer, Scope, digest
from kvstack.server.auth import AuthTenant, Tenant, tenant_id
from kvstack.server.errors import ApiError

logger = logging.getLogger("kvstack.server")

HEADER = "x-kvstack-semantic-cache"
_LOOKUP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

router = APIRouter()


class SemanticMetrics:
    def __init__(self, registry: CollectorRegistry, cache: SemanticCache) -> None:
        prefix = "kvstack_semantic_cache"
        self.lookups = Counter(f"{prefix}_lookups", "requests looked up in the semantic cache",
                               registry=registry)
        self.hits = Counter(f"{prefix}_hits", "requests answered from the semantic cache",
                            registry=registry)
        self.guard_rejections = Counter(
            f"{prefix}_guard_rejections",
            "cached questions over the similarity threshold that the guard refused",
            registry=registry)
        self.stores = Counter(f"{prefix}_stores", "answers stored in the semantic cache",
                              registry=registry)
        self.latency = Histogram(f"{prefix}_lookup_seconds",
                                 "semantic cache lookup time (embedding, search and guard)",
                                 buckets=_LOOKUP_BUCKETS, registry=registry)
        entries = Gauge(f"{prefix}_entries", "entries in the semantic cache", registry=registry)
        entries.set_function(lambda: len(cache))
        self.num_lookups = 0  # the counters above, as plain numbers for the live view
        self.num_hits = 0

    def observe(self, lookup: Lookup) -> None:
        self.lookups.inc()
        self.num_lookups += 1
        if lookup.hit:
            self.hits.inc()
            self.num_hits += 1
        self.guard_rejections.inc(len(lookup.rejections))
        self.latency.observe(lookup.seconds)


class SemanticService:
    """One app's semantic cache, bound to the model it serves."""

    def __init__(self, cache: SemanticCache, model_fingerprint: str,
                 registry: CollectorRegistry, owned: bool) -> None:
        self.cache = cache
        self.model = model_fingerprint
        self.metrics = SemanticMetrics(registry, cache)
        self.owned = owned

    @classmethod
    def build(cls, config: SemanticCacheConfig, model_fingerprint: str,
              registry: CollectorRegistry) -> SemanticService:
        from kvstack.semantic.embedder import MiniLMEmbedder

        return cls(SemanticCache(MiniLMEmbedder(), config), model_fingerprint, registry,
                   owned=True)

    async def probe(self, tenant: Tenant, api: str, key_text: str | None, context: Any,
                    sampling_params: SamplingParams, requested_max_tokens: int | None,
                    opt_in: bool | None, user_salt: str | None) -> Probe | None:
        """Look the request up; None when it may not use the cache."""
        sp = sampling_params
        deterministic = sp.greedy or sp.top_k == 1
        if (opt_in is False or not key_text or not key_text.strip() or sp.n != 1
                or sp.logprobs is not None or not (deterministic or opt_in)):
            return None
        fields = dataclasses.asdict(sp) | {"max_tokens": requested_max_tokens}
        scope = Scope(tenant_id(tenant), self.model,
                      digest({"api": api, "context": context, "params": fields,
                              "salt": user_salt}))
        lookup = await asyncio.to_thread(self.cache.lookup, scope, key_text)
        self.metrics.observe(lookup)
        return Probe(self, scope, key_text, lookup)

    def close(self) -> None:
        if self.owned:
            self.cache.close()


class Probe:
    """One request's use of the cache: its scope and key text, and the hit if there was one."""

    def __init__(self, service: SemanticService, scope: Scope, text: str,
                 lookup: Lookup) -> None:
        self.service = service
        self.scope = scope
        self.text = text
        self.lookup = lookup

    @property
    def hit(self) -> bool:
        return self.lookup.hit

    @property
    def mode(self) -> str:
        return self.service.cache.config.mode

    @property
    def replays(self) -> bool:
        """Trust mode and a hit: the stored answer is served as it is."""
        return self.hit and self.mode == "trust"

    @property
    def headers(self) -> dict[str, str]:
        return {HEADER: "hit" if self.hit else "miss"}

    def replay(self, request_id: str, prompt_token_ids: list[int]) -> Replay:
        assert self.lookup.entry is not None
        return Replay(self.lookup.entry.answer, request_id, prompt_token_ids)

    def draft(self, tokenizer: Any) -> list[int] | None:
        """Verify mode and a hit: the stored answer's tokens, for the engine to verify."""
        if not self.hit or self.mode != "verify":
            return None
        assert self.lookup.entry is not None
        answer = self.lookup.entry.answer
        if answer.token_ids is not None:
            return list(answer.token_ids)
        return list(tokenizer.encode(answer.text, add_special_tokens=False))

    def usage(self, out: RequestOutput) -> dict[str, Any]:
        """`usage.semantic_cache`: the mode, and the draft tokens verified and accepted."""
        return {"mode": self.mode, "hit": self.hit, "draft_tokens": out.num_draft_tokens,
                "accepted_tokens": out.num_accepted_tokens}

    async def store(self, out: RequestOutput) -> None:
        """Keep a finished model answer (never a replayed one, an abort or an error). In
        verify mode a hit's output is the model's own, so it is kept under its own text."""
        completion = out.outputs[0]
        if self.replays or not out.finished or completion.finish_reason not in ("stop", "length"):
            return
        answer = Answer(completion.text, len(completion.token_ids), completion.finish_reason,
                        completion.stop_reason, tuple(completion.token_ids))
        try:
            await asyncio.to_thread(self.service.cache.store, self.scope, self.text, answer,
                                    self.lookup.vector)
        except Exception:  # a cache that cannot store must not fail the answer
            logger.exception("semantic cache: storing an answer failed")
            return
        self.service.metrics.stores.inc()


class Replay:
    """A cached answer played back as an `OutputStream`: cumulative outputs a word at a
    time, so a hit streams like a model run (and no engine request exists to abort)."""

    def __init__(self, answer: Answer, request_id: str, prompt_token_ids: list[int]) -> None:
        self.finished = False
        self._answer = answer
        self._request_id = request_id
        self._prompt_token_ids = prompt_token_ids
        self._pieces = re.findall(r"\s*\S+", answer.text) or [answer.text]
        self._pieces[-1] += answer.text[len("".join(self._pieces)):]  # trailing whitespace
        self._sent = 0
        self._metrics = RequestMetrics(arrival_time=time.perf_counter())

    async def next(self) -> RequestOutput:
        self._sent = min(self._sent + 1, len(self._pieces))
        last = self._sent == len(self._pieces)
        self.finished = last
        text = "".join(self._pieces[: self._sent])
        num_tokens = self._answer.num_output_tokens * self._sent // len(self._pieces)
        completion = CompletionOutput(0, text, [0] * num_tokens,
                                      finish_reason=self._answer.finish_reason if last else None,
                                      stop_reason=self._answer.stop_reason if last else None)
        return RequestOutput(self._request_id, None, self._prompt_token_ids, [completion], last,
                             0, self._metrics)

    def close(self) -> None:
        self.finished = True


def split_conversation(messages: list[dict[str, str]]) -> tuple[str | None, Any]:
    """(the last user message, the turns before and after it) of a chat."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        return None, messages
    i = users[-1]
    return messages[i].get("content", ""), [messages[:i], messages[i + 1:]]


# -- admin routes ----------------------------------------------------------------------------


def _service(request: Request) -> SemanticService:
    service = request.app.state.kvstack.semantic
    if service is None:
        raise ApiError(404, "the semantic cache is off; start the server with --semantic-cache",
                       code="semantic_cache_disabled")
    return service


@router.get("/v1/semantic_cache")
async def describe(request: Request, tenant: AuthTenant) -> dict[str, Any]:
    """The caller's tenant id and entry count, and the cache's settings."""
    service = _service(request)
    config = service.cache.config
    own = tenant_id(tenant)
    return {"object": "semantic_cache", "tenant": own, "entries": service.cache.count(own),
            "mode": config.mode, "threshold": config.threshold, "ttl_s": config.ttl_s,
            "max_entries": config.max_entries}


@router.delete("/v1/semantic_cache")
async def invalidate(request: Request, tenant: AuthTenant,
                     target: str | None = Query(None, alias="tenant"),
                     model: str | None = None) -> dict[str, Any]:
    """Drop the caller's entries (optionally only `model`'s). `tenant=all` or another
    tenant's id is only allowed on a server without API keys, where every caller is the one
    public tenant: with keys, a key's rights end at its own tenant."""
    service = _service(request)
    state = request.app.state.kvstack
    own = tenant_id(tenant)
    target = target or own
    if target != own and state.keys.enabled:
        raise ApiError(403, f"this key may invalidate only its own tenant ({own}); leave "
                            "'tenant' out", param="tenant", code="permission_denied")
    fingerprint = None
    if model is not None:
        state.check_model(model)
        fingerprint = service.model
    deleted = await asyncio.to_thread(service.cache.invalidate,
                                      None if target == "all" else target, fingerprint)
    return {"object": "semantic_cache.invalidation", "tenant": target, "model": model,
            "deleted": deleted}
