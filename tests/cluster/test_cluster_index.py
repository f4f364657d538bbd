"""The router-side resident-block index and the replica-side residency log. Pure Python."""

from __future__ import annotations

import random

from helpers.kv_requests import prefill
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstack.cluster.events import (
    BlockEvents,
    Snapshot,
    block_key,
    block_keys,
    decode_keys,
    encode_keys,
)
from kvstack.cluster.index import Applied, KeyMasks, ResidentIndex, held_prefix, prefix_lengths
from kvstack.cluster.residency import ResidencyLog
from kvstack.cluster.router import request_keys
from kvstack.cluster.scoring import Layout
from kvstack.kv.block_hash import hash_block
from kvstack.kv.manager import KVCacheManager

KEYS = st.integers(0, 30)  # a small key space, so replicas overlap and prefixes collide


def brute_prefix(held: set[int], keys: list[int]) -> int:
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n


# --- longest prefix -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sets(KEYS, max_size=25), min_size=1, max_size=12),
       st.lists(KEYS, max_size=20))
def test_prefix_lengths_match_a_brute_force(held: list[set[int]], request: list[int]) -> None:
    index = ResidentIndex(max_blocks_per_replica=64)
    for i, keys in enumerate(held):
        index.add_replica(f"r{i}")
        index.apply_snapshot(f"r{i}", Snapshot("e", 0, sorted(keys)))
    lengths = index.prefix_lengths(request)
    for i, keys in enumerate(held):
        expected = brute_prefix(keys, request)
        assert index.longest_prefix(f"r{i}", request) == expected
        assert lengths.get(index.slot(f"r{i}"), 0) == expected
        assert held_prefix(index.slot(f"r{i}"), request, [index.table]) == expected
    assert all(n > 0 for n in lengths.values())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sets(KEYS, max_size=20), min_size=2, max_size=6),
       st.lists(st.sets(KEYS, max_size=20), min_size=2, max_size=6),
       st.lists(KEYS, max_size=20), st.integers(0, 25))
def test_tables_are_ored_per_key(a: list[set[int]], b: list[set[int]], request: list[int],
                                 limit: int) -> None:
    """A slot holds a block if either table says so (index + the router's own record)."""
    first, second = KeyMasks(), KeyMasks()
    for slot, keys in enumerate(a):
        first.add(slot, keys)
    for slot, keys in enumerate(b):
        second.add(slot, keys)
    got = prefix_lengths(request, [first, second], limit)
    for slot in range(max(len(a), len(b))):
        union = (a[slot] if slot < len(a) else set()) | (b[slot] if slot < len(b) else set())
        assert got.get(slot, 0) == brute_prefix(union, request[:limit])


def test_many_replicas_share_one_walk() -> None:
    index = ResidentIndex(max_blocks_per_replica=100)
    keys = list(range(100, 150))
    for i in range(300):  # masks wider than a machine word
        index.add_replica(f"r{i}")
        index.apply_snapshot(f"r{i}", Snapshot("e", 0, keys[: i % 50]))
    lengths = index.prefix_lengths(keys)
    assert len(lengths) == 300 - 6  # replicas 0, 50, 100, ... hold nothing
    assert all(lengths[index.slot(f"r{i}")] == i % 50 for i in range(300) if i % 50)


# --- events, gaps, snapshots ----------------------------------------------------------------


def test_in_order_events_apply_and_duplicates_are_ignored() -> None:
    index = ResidentIndex(max_blocks_per_replica=10)
    assert index.apply_events("a", BlockEvents("e1", 0, stored=[1, 2, 3])) is Applied.APPLIED
    assert index.apply_events("a", BlockEvents("e1", 1, stored=[4], removed=[2])) \
        is Applied.APPLIED
    assert index.apply_events("a", BlockEvents("e1", 1, stored=[9])) is Applied.DUPLICATE
    assert index.longest_prefix("a", [1, 3, 4, 2]) == 3
    assert not index.needs_snapshot("a")


def test_a_gap_asks_for_a_snapshot_which_heals_it() -> None:
    index = ResidentIndex(max_blocks_per_replica=10)
    index.apply_events("a", BlockEvents("e1", 0, stored=[1, 2]))
    # Batch 1 (stored 3, removed 1) is lost; batch 2 still applies as a hint.
    assert index.apply_events("a", BlockEvents("e1", 2, stored=[4])) is Applied.NEED_SNAPSHOT
    assert index.needs_snapshot("a")
    assert index.longest_prefix("a", [1, 2, 4]) == 3  # wrong: 1 was removed in batch 1
    # The replica answers with a snapshot as of batch 1; batch 2 is replayed on top.
    assert index.apply_snapshot("a", Snapshot("e1", 1, [2, 3])) is Applied.APPLIED
    assert not index.needs_snapshot("a")
    assert index.longest_prefix("a", [2, 3, 4]) == 3
    assert index.longest_prefix("a", [1]) == 0
    assert index.apply_events("a", BlockEvents("e1", 3, removed=[4])) is Applied.APPLIED


def test_a_snapshot_older_than_the_replay_window_stays_stale() -> None:
    index = ResidentIndex(max_blocks_per_replica=10, replay_window=2)
    index.apply_events("a", BlockEvents("e1", 0, stored=[1]))
    for seq in range(2, 6):  # batch 1 lost; only batches 4 and 5 stay in the window
        index.apply_events("a", BlockEvents("e1", seq, stored=[seq]))
    assert index.apply_snapshot("a", Snapshot("e1", 1, [1])) is Applied.NEED_SNAPSHOT
    assert index.apply_snapshot("a", Snapshot("e1", 5, [1, 2, 3, 4, 5])) is Applied.APPLIED


def test_a_new_epoch_forgets_the_old_incarnation() -> None:
    index = ResidentIndex(max_blocks_per_replica=10)
    index.apply_events("a", BlockEvents("old", 0, stored=[1, 2]))
    # A restarted replica starts empty: its batch 0 is its whole history.
    assert index.apply_events("a", BlockEvents("new", 0, stored=[7])) is Applied.APPLIED
    assert index.longest_prefix("a", [1]) == 0 and index.longest_prefix("a", [7]) == 1
    # Joining a new epoch mid-stream: we cannot know what came before.
    assert index.apply_events("a", BlockEvents("newer", 5, stored=[8])) is Applied.NEED_SNAPSHOT
    assert index.longest_prefix("a", [7]) == 0


def test_memory_is_bounded_per_replica() -> None:
    index = ResidentIndex(max_blocks_per_replica=4)
    assert index.apply_events("a", BlockEvents("e", 0, stored=range(10))) \
        is Applied.NEED_SNAPSHOT
    assert index.num_blocks("a") == 4 and len(index.table) == 4
    assert index.apply_snapshot("a", Snapshot("e", 0, list(range(100, 110)))) \
        is Applied.NEED_SNAPSHOT
    assert index.num_blocks("a") == 4 and len(index.table) == 4


def test_removing_a_replica_frees_its_slot_clean() -> None:
    index = ResidentIndex(max_blocks_per_replica=10)
    index.apply_snapshot("a", Snapshot("e", 0, [1, 2]))
    index.apply_snapshot("b", Snapshot("e", 0, [1]))
    slot = index.slot("a")
    index.remove_replica("a")
    assert "a" not in index
    assert index.add_replica("c") == slot  # reused
    assert index.longest_prefix("c", [1, 2]) == 0
    assert index.prefix_lengths([1, 2]) == {index.slot("b"): 1}
    assert len(index.table) == 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "remove", "clear", "drain"]),
                          st.lists(KEYS, max_size=6)), max_size=60),
       st.randoms(use_true_random=False))
def test_a_lossy_event_stream_plus_snapshots_tracks_the_replica(ops: list, rnd: random.Random
                                                                 ) -> None:
    """Whatever batches are lost, each gap is detected, and a snapshot restores the truth."""
    log = ResidencyLog("e")
    index = ResidentIndex(max_blocks_per_replica=64)
    index.apply_snapshot("a", log.snapshot())
    for op, keys in ops:
        if op == "store":
            log.stored(keys)
        elif op == "remove":
            log.removed(keys)
        elif op == "clear":
            log.cleared()
        batch = log.drain()
        if batch is None or rnd.random() < 0.3:
            continue  # nothing to send, or the batch is lost
        result = index.apply_events("a", batch)
        if result is Applied.NEED_SNAPSHOT:
            assert index.apply_snapshot("a", log.snapshot()) is Applied.APPLIED
        if not index.needs_snapshot("a"):
            # Right after a batch applies, any batch lost before it shows as a gap; none
            # shown means none lost, and the view is exact.
            assert index.longest_prefix("a", sorted(log.resident)) == len(log.resident)
            assert index.num_blocks("a") == len(log.resident)
    final = log.drain()
    if final is not None:
        index.apply_events("a", final)
    index.apply_snapshot("a", log.snapshot())
    assert index.num_blocks("a") == len(log.resident)
    assert index.longest_prefix("a", sorted(log.resident)) == len(log.resident)


def test_residency_log_batches_are_net_changes() -> None:
    log = ResidencyLog("e")
    assert log.drain() is None
    log.stored([1, 2, 3])
    log.removed([2])
    log.stored([2])
    log.removed([9])  # never held: no event
    batch = log.drain()
    assert batch is not None and batch.seq == 0
    assert sorted(batch.stored) == [1, 2, 3] and list(batch.removed) == []
    log.removed([1])
    log.stored([1])
    batch = log.drain()
    assert batch is not None and batch.seq == 1 and list(batch.stored) == [1]
    assert log.snapshot() == Snapshot("e", 1, sorted(log.resident))


# --- keys -----------------------------------------------------------------------------------


def test_keys_encode_compactly_and_round_trip() -> None:
    keys = [0, 1, 2**64 - 1, 12345678901234567]
    data = encode_keys(keys)
    assert len(data) == 8 * len(keys)
    assert decode_keys(data) == keys
    h = hash_block(None, [1, 2, 3], ("fp", ""))
    assert block_key(h) == int.from_bytes(h[:8], "little") == block_keys([h])[0]


def test_router_keys_are_the_blocks_the_engine_publishes() -> None:
    """The ingress must name blocks exactly as a replica's KV manager publishes them: same
    fingerprint, same salt, and a salt or model of its own gives other keys."""
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True,
                             fingerprint="fp-1")
    tokens = list(range(23))
    layout = Layout("fp-1", 4, "float32")
    for i, salt in enumerate((None, "tenant-a")):
        prefill(manager, f"r{i}", tokens, salt)
        published = block_keys(manager.block_hashes(f"r{i}"))
        assert request_keys(tokens, layout, salt) == published
        assert len(published) == 5
    assert request_keys(tokens, layout, None) != request_keys(tokens, layout, "tenant-a")
    assert request_keys(tokens, Layout("fp-2", 4, "float32"), None) != request_keys(
        tokens, layout, None)
    manager.check_integrity()
