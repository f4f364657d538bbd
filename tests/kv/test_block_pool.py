"""BlockPool (ref counts, LRU free queue, hash index) and chained block hashes. Pure Python."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstack.kv.block_hash import hash_block, hash_full_blocks
from kvstack.kv.block_pool import BlockPool, KVBlock


class Mirror:
    """A BlockListener that keeps the set of hashes it was told are cached."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()
        self.num_events = 0

    def blocks_stored(self, hashes: Sequence[bytes]) -> None:
        assert not self.hashes & set(hashes), "stored twice without a removal"
        self.hashes.update(hashes)
        self.num_events += 1

    def blocks_removed(self, hashes: Sequence[bytes]) -> None:
        assert set(hashes) <= self.hashes, "removed a hash never stored"
        self.hashes.difference_update(hashes)
        self.num_events += 1


def h(name: str) -> bytes:
    """A stand-in block hash; the pool only needs distinct hashable values."""
    return hash_block(None, [], (name,))


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def cached_names(pool: BlockPool, names: str) -> str:
    """Which of the one-letter hash names are still in the index, e.g. 'ac'."""
    return "".join(n for n in names if pool.lookup(h(n)) is not None)


# --- basic accounting ---------------------------------------------------------------------


def test_fresh_pool_hands_out_blocks_in_id_order() -> None:
    pool = BlockPool(4)
    pool.check_integrity()
    assert (pool.num_blocks, pool.num_free, pool.num_in_use, pool.num_cached_free) == (4, 4, 0, 0)
    got = pool.allocate(3)
    assert ids(got) == [0, 1, 2]
    assert all(b.ref_cnt == 1 and b.block_hash is None for b in got)
    assert (pool.num_free, pool.num_in_use) == (1, 3)
    pool.check_integrity()
    pool.free(got)
    assert (pool.num_free, pool.num_in_use) == (4, 0)
    pool.check_integrity()


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    held = pool.allocate(2)
    with pytest.raises(RuntimeError, match=r"allocate\(2\) with only 1 free"):
        pool.allocate(2)
    assert (pool.num_free, pool.num_in_use) == (1, 2)
    pool.check_integrity()
    pool.free(held)
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_shared_block_is_free_only_after_last_unref() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.cache(block, h("a"))
    pool.touch([block])  # a second request hits the in-use block
    assert block.ref_cnt == 2 and pool.num_free == 1
    pool.free([block])
    assert block.ref_cnt == 1 and pool.num_free == 1
    pool.check_integrity()
    pool.free([block])
    assert block.ref_cnt == 0 and pool.num_free == 2 and pool.num_cached_free == 1
    assert pool.lookup(h("a")) is block
    pool.check_integrity()


def test_cache_first_writer_wins() -> None:
    pool = BlockPool(3)
    first, second = pool.allocate(2)
    pool.cache(first, h("a"))
    pool.cache(second, h("a"))  # the same content computed twice at once
    assert pool.lookup(h("a")) is first and second.block_hash is None
    pool.cache(first, h("b"))  # a block keeps the hash it was published under
    assert first.block_hash == h("a") and pool.lookup(h("b")) is None
    pool.check_integrity()
    pool.free([first, second])
    pool.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    pool = BlockPool(3)
    [block] = pool.allocate(1)
    pool.free([block])
    pool.free([block])  # double free
    with pytest.raises(AssertionError, match="negative ref count"):
        pool.check_integrity()

    pool = BlockPool(3)
    pool.blocks[0].ref_cnt = 1  # a reference taken behind the pool's back
    with pytest.raises(AssertionError):
        pool.check_integrity()

    pool = BlockPool(3)
    pool.blocks[1].block_hash = h("x")  # hashed but not indexed
    with pytest.raises(AssertionError):
        pool.check_integrity()


# --- eviction order -----------------------------------------------------------------------


def test_eviction_order_is_lru_tail_first_and_hits_move_to_mru() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)  # blocks 0 1 2: request A's prefix a0 a1 a2
    b = pool.allocate(2)  # blocks 3 4:   request B's prefix b0 b1
    for block, name in zip(a + b, "abcde", strict=True):
        pool.cache(block, h(name))
    # A finishes first, then B; each frees tail first (as KVCacheManager.free does).
    pool.free(reversed(a))
    pool.free(reversed(b))
    pool.check_integrity()
    assert pool.num_cached_free == 5 and pool.num_evictions == 0
    # Free queue, LRU first: 5 (never used) | 2 1 0 (A, tail first) | 4 3 (B, tail first).
    assert ids(pool.allocate(1)) == [5]
    assert cached_names(pool, "abcde") == "abcde"  # an empty block goes without evicting
    assert ids(pool.allocate(1)) == [2]
    assert cached_names(pool, "abcde") == "abde" and pool.num_evictions == 1
    # A hit on A's head revives blocks 0 and 1; freed again they join the MRU end.
    hit = [pool.lookup(h("a")), pool.lookup(h("b"))]
    assert ids(hit) == [0, 1]  # type: ignore[arg-type]
    pool.touch(hit)  # type: ignore[arg-type]
    assert pool.num_free == 2 and pool.num_cached_free == 2
    pool.check_integrity()
    pool.free(reversed(hit))  # type: ignore[arg-type]
    # Queue now: 4 3 (B) | 1 0 (A again, tail first).
    assert ids(pool.allocate(1)) == [4]
    assert cached_names(pool, "abcde") == "abd"
    assert ids(pool.allocate(2)) == [3, 1]
    assert cached_names(pool, "abcde") == "a" and pool.num_evictions == 4
    assert ids(pool.allocate(1)) == [0]
    assert cached_names(pool, "abcde") == "" and pool.num_evictions == 5
    assert all(blk.block_hash is None and blk.ref_cnt == 1 for blk in pool.blocks)
    pool.check_integrity()


def test_reset_prefix_cache_drops_only_free_cached_blocks() -> None:
    pool = BlockPool(4)
    held, freed, plain = pool.allocate(1), pool.allocate(2), pool.allocate(1)
    pool.cache(held[0], h("held"))
    pool.cache(freed[0], h("f0"))
    pool.cache(freed[1], h("f1"))
    pool.free(reversed(freed))
    pool.free(plain)
    assert pool.num_cached_free == 2
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached_free == 0 and pool.num_free == 3
    assert pool.lookup(h("f0")) is None and pool.lookup(h("f1")) is None
    assert pool.lookup(h("held")) is held[0]  # in use: still valid, still shared
    pool.check_integrity()
    assert pool.reset_prefix_cache() == 0
    pool.free(held)
    pool.check_integrity()


# --- block hashes -------------------------------------------------------------------------


def test_equal_blocks_at_different_depths_hash_differently() -> None:
    tokens = [7, 7, 7, 7] * 3
    hashes = hash_full_blocks(tokens, 4, ("model", ""), [])
    assert len(hashes) == 3 and len(set(hashes)) == 3
    assert all(isinstance(x, bytes) and len(x) == 32 for x in hashes)  # sha256


def test_hash_chain_names_the_whole_prefix() -> None:
    a = hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, ("m", ""), [])
    b = hash_full_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4, ("m", ""), [])
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different parent
    assert a == hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, ("m", ""), [])  # deterministic


def test_hash_full_blocks_ignores_partial_tail_and_extends_known() -> None:
    tokens = list(range(11))
    full = hash_full_blocks(tokens, 4, ("m", ""), [])
    assert len(full) == 2  # 11 tokens: two full blocks, three left over
    assert hash_full_blocks(tokens[:3], 4, ("m", ""), []) == []
    assert hash_full_blocks(tokens, 4, ("m", ""), full[:1]) == full
    assert hash_full_blocks(tokens + [11], 4, ("m", ""), full) == hash_full_blocks(
        tokens + [11], 4, ("m", ""), []
    )


def test_extra_keys_separate_tenants_and_models() -> None:
    tokens = list(range(8))
    base = hash_full_blocks(tokens, 4, ("m", ""), [])
    salted = hash_full_blocks(tokens, 4, ("m", "alice"), [])
    other_model = hash_full_blocks(tokens, 4, ("m2", ""), [])
    assert not set(base) & set(salted) and not set(base) & set(other_model)
    assert salted == hash_full_blocks(tokens, 4, ("m", "alice"), [])


def test_listener_hears_publications_evictions_and_resets_and_starts_from_the_pool() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, h("a"))
    late = Mirror()
    pool.add_listener(late)  # told of what is cached already
    assert late.hashes == {h("a")}
    pool.cache(b, h("b"))
    pool.cache(c, h("a"))  # a duplicate hash is not published, so nobody hears of it
    assert late.hashes == {h("a"), h("b")} == set(pool.cached_hashes())
    pool.free([c, b, a])
    pool.allocate(1)  # evicts c (uncached) first: nothing to hear
    assert late.hashes == {h("a"), h("b")}
    pool.allocate(1)  # evicts b
    assert late.hashes == {h("a")}
    assert pool.reset_prefix_cache() == 1
    assert late.hashes == set() == set(pool.cached_hashes())


# --- property: random operation sequences against a model of the pool -------------------


class PoolMachine(RuleBasedStateMachine):
    """Drives BlockPool with random allocate / touch / free / cache / reset and predicts
    exactly which blocks `allocate` hands out and which cached hashes it evicts."""

    NUM_BLOCKS = 8

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS)
        self.refs: list[KVBlock] = []  # one entry per reference held by "requests"
        self.free_order = list(range(self.NUM_BLOCKS))  # model of the LRU queue
        self.hash_of: dict[int, bytes] = {}  # model of block id -> published hash
        self.next_hash = 0
        self.mirror = Mirror()
        self.pool.add_listener(self.mirror)

    def _model_ref_cnt(self, block_id: int) -> int:
        return sum(1 for b in self.refs if b.block_id == block_id)

    @rule(n=st.integers(0, 4))
    def allocate(self, n: int) -> None:
        if n > len(self.free_order):
            with pytest.raises(RuntimeError):
                self.pool.allocate(n)
            return
        expected = self.free_order[:n]
        del self.free_order[:n]
        got = self.pool.allocate(n)
        assert ids(got) == expected
        for block in got:
            assert block.block_hash is None and block.ref_cnt == 1
            gone = self.hash_of.pop(block.block_id, None)
            if gone is not None:
                assert self.pool.lookup(gone) is None
        self.refs.extend(got)

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        block = self.refs.pop(data.draw(st.integers(0, len(self.refs) - 1)))
        self.pool.free([block])
        if self._model_ref_cnt(block.block_id) == 0:
            self.free_order.append(block.block_id)

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(self.refs))
        if block.block_id in self.hash_of:
            return
        self.next_hash += 1
        block_hash = h(str(self.next_hash))
        self.pool.cache(block, block_hash)
        self.hash_of[block.block_id] = block_hash
        assert self.pool.lookup(block_hash) is block

    @precondition(lambda self: self.hash_of)
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(sorted(self.hash_of)))
        block = self.pool.lookup(self.hash_of[block_id])
        assert block is not None and block.block_id == block_id
        self.pool.touch([block])
        if block_id in self.free_order:
            self.free_order.remove(block_id)
        self.refs.append(block)

    @rule()
    def reset_prefix_cache(self) -> None:
        dropped = [i for i in self.free_order if i in self.hash_of]
        assert self.pool.reset_prefix_cache() == len(dropped)
        for i in dropped:
            assert self.pool.lookup(self.hash_of.pop(i)) is None

    @invariant()
    def pool_matches_model(self) -> None:
        self.pool.check_integrity()
        assert self.pool.num_free == len(self.free_order)
        assert self.pool.num_in_use == self.NUM_BLOCKS - len(self.free_order)
        assert self.pool.num_cached_free == sum(1 for i in self.free_order if i in self.hash_of)
        for block in self.pool.blocks:
            assert block.ref_cnt == self._model_ref_cnt(block.block_id)
        # A listener's view is exactly the prefix cache, after any sequence of operations.
        assert self.mirror.hashes == set(self.hash_of.values()) == set(self.pool.cached_hashes())

    def teardown(self) -> None:
        self.pool.free(self.refs)
        self.pool.check_integrity()
        assert self.pool.num_in_use == 0


PoolMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, derandomize=True
)
TestBlockPoolStateMachine = PoolMachine.TestCase
