"""Pinned prefixes (prompt caching): extra references with deadlines, a cap, and yielding to
requests that would otherwise not fit. Pure Python, no model."""

from __future__ import annotations

from collections.abc import Sequence

from kvstack.engine.detokenizer import IncrementalDetokenizer, NullDecoder
from kvstack.engine.request import Request
from kvstack.kv.manager import KVCacheManager
from kvstack.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, prompt: Sequence[int], salt: str | None = None) -> Request:
    ids = list(prompt)
    return Request(request_id=request_id, prompt=None, prompt_token_ids=ids,
                   sampling_params=SamplingParams(max_tokens=1), max_tokens=1,
                   detokenizer=IncrementalDetokenizer(NullDecoder(), ids), cache_salt=salt)


def cache_prompt(kv: KVCacheManager, prompt: Sequence[int], salt: str | None = None) -> None:
    """Run a request's prefill through the manager and finish it: its full blocks stay cached."""
    request = make_request(str(id(prompt)), prompt, salt)
    hit = kv.match_prefix(request)
    assert kv.allocate(request, len(prompt) - hit.num_tokens, hit)
    request.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(request)
    kv.free(request.request_id)


def hit_tokens(kv: KVCacheManager, prompt: Sequence[int], salt: str | None = None) -> int:
    return kv.match_prefix(make_request("probe", prompt, salt)).num_tokens


def manager(num_blocks: int = 8, max_pinned: int | None = None) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, True, "fp", max_pinned)


PROMPT = list(range(100, 113))  # 3 full blocks + 1 token


def test_pin_holds_a_reference_that_reset_and_lru_pressure_pass_by() -> None:
    kv = manager()
    cache_prompt(kv, PROMPT)
    assert kv.pin_prefix(PROMPT, None, until=10.0) == (12, 0)
    assert (len(kv.pins), kv.pool.num_in_use) == (3, 3)
    kv.pool.check_integrity()
    kv.pins.check_integrity()
    assert kv.reset_prefix_cache() == 0
    for start in (200, 300):  # churn every unpinned block of the pool
        cache_prompt(kv, list(range(start, start + 5 * BS)))
    assert hit_tokens(kv, PROMPT + [0]) == 12
    assert hit_tokens(kv, list(range(200, 200 + 5 * BS)) + [0]) == 0  # evicted by the churn
    kv.pool.check_integrity()
    kv.pins.check_integrity()


def test_pins_are_per_salt_and_stop_at_the_first_uncached_block() -> None:
    kv = manager()
    cache_prompt(kv, PROMPT[:9])  # 2 full blocks cached
    assert kv.pin_prefix(PROMPT, None, 10.0) == (8, 0)
    assert kv.pin_prefix(PROMPT, "tenant-b", 10.0) == (0, 0)


def test_pinning_again_refreshes_to_the_later_deadline() -> None:
    kv = manager()
    cache_prompt(kv, PROMPT)
    kv.pin_prefix(PROMPT, None, until=10.0)
    assert kv.pin_prefix(PROMPT[:8], None, until=20.0) == (0, 8)
    assert kv.pins.expire(15.0) == 1  # the third block kept its own deadline
    assert kv.pins.expire(19.0) == 0
    assert kv.pins.expire(20.0) == 2
    assert kv.pool.num_in_use == 0
    # Lapsed pins leave the blocks cached, merely evictable again.
    assert hit_tokens(kv, PROMPT) == 12
    kv.pool.check_integrity()


def test_over_the_cap_the_least_recently_refreshed_pins_lapse_tail_first() -> None:
    kv = manager(num_blocks=12, max_pinned=4)
    other = list(range(500, 512))
    cache_prompt(kv, PROMPT)
    cache_prompt(kv, other)
    kv.pin_prefix(PROMPT, None, 10.0)
    assert kv.pin_prefix(other, None, 10.0) == (12, 0)
    # PROMPT's tail lapsed first and then its second block; its head is still pinned.
    assert len(kv.pins) == 4
    assert kv.pin_prefix(PROMPT[:4], None, 10.0) == (0, 4)
    assert kv.pin_prefix(PROMPT, None, 10.0) == (8, 4)
    kv.pins.check_integrity()
    kv.pool.check_integrity()


def test_a_request_short_of_blocks_gets_them_from_pins_all_or_nothing() -> None:
    kv = manager(num_blocks=6, max_pinned=3)
    cache_prompt(kv, PROMPT)
    kv.pin_prefix(PROMPT, None, 10.0)  # 3 of 6 blocks pinned
    running = make_request("big", list(range(700, 700 + 4 * BS)))
    assert kv.allocate(running, 4 * BS)  # needs 4 blocks: one pin yields
    assert len(kv.pins) == 2 and kv.pool.num_free == 0
    running.num_computed_tokens = 4 * BS
    # Needing 3 more with only 2 pins to give: no pin is lapsed in vain.
    assert not kv.allocate(running, 3 * BS)
    assert len(kv.pins) == 2
    kv.free(running.request_id)
    kv.pool.check_integrity()
    kv.pins.check_integrity()


def test_a_prefix_hit_on_pinned_blocks_keeps_them_pinned() -> None:
    kv = manager(num_blocks=6)
    cache_prompt(kv, PROMPT)
    assert kv.pin_prefix(PROMPT, None, 10.0) == (12, 0)
    request = make_request("reuse", PROMPT + list(range(900, 900 + BS)))
    hit = kv.match_prefix(request)
    assert hit.num_tokens == 12
    assert kv.allocate(request, request.num_tokens - hit.num_tokens, hit)
    assert all(b.ref_cnt == 2 for b in kv.blocks(request.request_id)[:3])
    kv.free(request.request_id)
    assert kv.pool.num_in_use == 3
    kv.pool.check_integrity()


def test_unpin_lapses_at_once_and_ignores_blocks_not_pinned() -> None:
    kv = manager()
    cache_prompt(kv, PROMPT)
    kv.pin_prefix(PROMPT, None, 10.0)
    request = make_request("probe", PROMPT)
    hashes = kv.match_prefix(request).block_hashes  # of the request's full blocks
    assert kv.pins.unpin(hashes[1:]) == 2
    assert kv.pins.unpin(hashes) == 1
    assert (len(kv.pins), kv.pool.num_in_use) == (0, 0)
    kv.pool.check_integrity()
