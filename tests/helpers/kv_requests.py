"""Requests driven through a `KVCacheManager` (or its coordinator) by hand, as the
scheduler would: no model."""

from __future__ import annotations

from collections.abc import Sequence

from kvstack.engine.detokenizer import IncrementalDetokenizer, NullDecoder
from kvstack.engine.request import Request
from kvstack.kv.coordinator import KVCacheCoordinator
from kvstack.kv.manager import KVCacheManager
from kvstack.sampling_params import SamplingParams


def make_request(request_id: str, prompt: Sequence[int], salt: str | None = None) -> Request:
    ids = list(prompt)
    return Request(request_id=request_id, prompt=None, prompt_token_ids=ids,
                   sampling_params=SamplingParams(max_tokens=1), max_tokens=1,
                   detokenizer=IncrementalDetokenizer(NullDecoder(), ids), cache_salt=salt)


def prefill(kv: KVCacheManager | KVCacheCoordinator, request_id: str, prompt: Sequence[int],
            salt: str | None = None) -> Request:
    """Admit a request, compute its prompt and publish its full blocks; it keeps its blocks
    until `kv.free(request_id)`."""
    request = make_request(request_id, prompt, salt)
    hit = kv.match_prefix(request)
    assert kv.allocate(request, len(prompt) - hit.num_tokens, hit)
    kv.record_query(request, hit)
    request.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(request)
    return request
