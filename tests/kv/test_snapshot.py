"""`KVCacheManager.snapshot()`: block states, what each published block holds (tokens, parent,
salt, origin), hits, holders, and the tiers' presence marks. Pure Python, no model."""

from __future__ import annotations

from collections.abc import Sequence

from helpers.kv_requests import prefill

from kvstack.kv.block_hash import BlockHash
from kvstack.kv.manager import KVCacheManager
from kvstack.kv.snapshot import CACHED, COMPUTED, FREE, IN_USE, PINNED, RESTORED, KVSnapshot
from kvstack.kv.tiers.presence import TierPresence

BS = 4
PROMPT = list(range(100, 113))  # 3 full blocks + 1 token


def counts(snap: KVSnapshot) -> dict[str, int]:
    return {state: snap.count(state) for state in (FREE, IN_USE, CACHED, PINNED)}


def usage_counts(kv: KVCacheManager) -> dict[str, int]:
    u = kv.usage()
    return {FREE: u.num_blocks_free - u.num_blocks_cached, IN_USE: u.num_blocks_used -
            u.num_blocks_pinned, CACHED: u.num_blocks_cached, PINNED: u.num_blocks_pinned}


def test_snapshot_states_match_usage_through_a_lifecycle() -> None:
    kv = KVCacheManager(12, BS, True, "fp")
    snap = kv.snapshot()
    assert snap.states == FREE * 12 and not snap.published and not snap.holders
    prefill(kv, "a", PROMPT, salt="tenant-a")
    snap = kv.snapshot()
    assert counts(snap) == usage_counts(kv) == {FREE: 8, IN_USE: 4, CACHED: 0, PINNED: 0}
    assert snap.holders == {0: ("a",), 1: ("a",), 2: ("a",), 3: ("a",)}
    assert snap.request_salts == {"a": "tenant-a"}
    kv.free("a")
    assert counts(kv.snapshot()) == usage_counts(kv) == {FREE: 9, IN_USE: 0, CACHED: 3, PINNED: 0}
    kv.pin_prefix(PROMPT, "tenant-a", until=1e12)
    snap = kv.snapshot()
    assert counts(snap) == usage_counts(kv) == {FREE: 9, IN_USE: 0, CACHED: 0, PINNED: 3}
    prefill(kv, "b", PROMPT + [7, 7, 7], salt="tenant-a")  # reads the pinned blocks
    snap = kv.snapshot()
    assert counts(snap) == usage_counts(kv)
    assert snap.count(PINNED) == 3 and snap.holders[0] == ("b",)
    kv.free("b")
    kv.check_integrity()


def test_published_blocks_chain_with_tokens_salt_and_hits() -> None:
    kv = KVCacheManager(16, BS, True, "fp")
    prefill(kv, "a", PROMPT, salt="s1")
    kv.free("a")
    snap = kv.snapshot()
    blocks = [snap.published[i] for i in range(3)]
    assert [b.token_ids for b in blocks] == [tuple(PROMPT[i * BS:(i + 1) * BS]) for i in range(3)]
    assert blocks[0].parent_hash is None
    assert [b.parent_hash for b in blocks[1:]] == [b.block_hash for b in blocks[:2]]
    assert {b.cache_salt for b in blocks} == {"s1"} and {b.origin for b in blocks} == {COMPUTED}
    assert [snap.uses[i].hits for i in range(3)] == [0, 0, 0]
    # A second request sharing two blocks hits them; a third with another salt hits nothing.
    prefill(kv, "b", PROMPT[:8] + [1, 2, 3, 4, 5], salt="s1")
    prefill(kv, "c", PROMPT, salt="s2")
    snap = kv.snapshot()
    assert [snap.uses[i].hits for i in range(3)] == [1, 1, 0]
    salts = {b.cache_salt for b in snap.published.values()}
    assert salts == {"s1", "s2"}
    assert len(snap.published) == 3 + 1 + 3  # b published its own third block
    for request_id in ("b", "c"):
        kv.free(request_id)
    kv.check_integrity()


def test_evicted_blocks_leave_the_snapshot() -> None:
    kv = KVCacheManager(4, BS, True, "fp")
    prefill(kv, "a", PROMPT)  # 4 blocks, 3 published
    kv.free("a")
    assert len(kv.snapshot().published) == 3
    prefill(kv, "b", list(range(500, 516)))  # needs all 4: evicts every cached block
    snap = kv.snapshot()
    assert snap.states == IN_USE * 4
    assert {b.token_ids[0] for b in snap.published.values()} == {500, 504, 508, 512}
    assert set(kv.log.live([b.block_hash for b in kv.pool.blocks])[0]) == set(snap.published)
    kv.free("b")


class _FakeTiers:
    """A tier chain holding a fixed set of hashes; marks what it 'restores' as present."""

    def __init__(self, held: set[BlockHash]) -> None:
        self.held = held
        self.presence_marks = TierPresence(["disk", "redis"], 100)

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.held:
            n += 1
        return n

    def restore(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> int:
        for block_hash in hashes[:len(block_ids)]:
            self.presence_marks.add(block_hash, 0)
        return min(len(hashes), len(block_ids))

    def offload(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        for _, block_hash in blocks:
            self.presence_marks.add(block_hash, 1)

    def presence(self, hashes: Sequence[BlockHash]) -> list[tuple[str, ...]]:
        return self.presence_marks.of(hashes)


def test_restored_blocks_are_published_with_their_tokens_and_tiers() -> None:
    warm = KVCacheManager(8, BS, True, "fp")
    hashes = warm.prefix_hashes(PROMPT, None)
    tiers = _FakeTiers(set(hashes[:2]))
    kv = KVCacheManager(8, BS, True, "fp", tiers=tiers)
    request = prefill(kv, "a", PROMPT)
    snap = kv.snapshot()
    by_hash = {b.block_hash: (i, b) for i, b in snap.published.items()}
    restored = [by_hash[h] for h in hashes[:2]]
    assert [b.origin for _, b in restored] == [RESTORED, RESTORED]
    assert [b.token_ids for _, b in restored] == [tuple(PROMPT[:4]), tuple(PROMPT[4:8])]
    assert restored[1][1].parent_hash == hashes[0]
    computed_id, computed = by_hash[hashes[2]]
    assert computed.origin == COMPUTED and computed.parent_hash == hashes[1]
    # Restored blocks: read from disk (tier 0); the computed one written through to redis.
    assert [snap.tiers[i] for i, _ in restored] == [("disk",), ("disk",)]
    assert snap.tiers[computed_id] == ("redis",)
    assert kv.usage().tier_hit_tokens == 8 and request.num_computed_tokens == len(PROMPT)
    kv.free("a")
    kv.check_integrity()


def test_presence_marks_clear_per_tier_and_forget_old_entries() -> None:
    marks = TierPresence(["disk", "redis"], capacity=2)
    marks.add(b"a", 0)
    marks.add(b"a", 1)
    marks.add(b"b", 1)
    assert marks.of([b"a", b"b", b"c"]) == [("disk", "redis"), ("redis",), ()]
    marks.clear([b"a"], 1)
    marks.clear([b"b"])
    assert marks.of([b"a", b"b"]) == [("disk",), ()]
    marks.add(b"c", 0)
    marks.add(b"d", 0)  # over capacity: the least recently marked ("a") goes
    assert marks.of([b"a", b"c", b"d"]) == [(), ("disk",), ("disk",)]
