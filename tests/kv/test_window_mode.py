"""The approximate window mode's bookkeeping (`kv/window_mode.py`) without a model: sinks kept,
blocks dropped as they slide out, a fork of a slid table copying its shared tail, preemption,
and a manager with a prefix cache refused."""

from __future__ import annotations

import pytest
from helpers.kv_requests import make_request

from kvstack.engine.request import Request
from kvstack.kv.manager import KVCacheManager
from kvstack.kv.mode import KVBlocks
from kvstack.kv.window import SlidingWindow
from kvstack.kv.window_mode import WindowModeKV

# 4 sink tokens (one block) and 8 recent ones, in 4-token blocks.
WINDOW = SlidingWindow(window=12, sink_tokens=4, block_size=4)


def window_kv() -> WindowModeKV:
    return WindowModeKV(KVCacheManager(16, 4, False, "fake-model"), WINDOW)


def step(kv: WindowModeKV, request: Request, num_new_tokens: int) -> KVBlocks:
    """One step of `num_new_tokens`: the blocks it ran with (what slid out is freed after)."""
    assert kv.allocate(request, num_new_tokens)
    blocks = kv.blocks_of(request.request_id)
    request.num_computed_tokens += num_new_tokens
    kv.after_step(request, None, rejected=False)
    return blocks


def test_the_sinks_stay_and_what_slid_out_is_dropped() -> None:
    kv = window_kv()
    request = make_request("a", range(3, 45))
    assert step(kv, request, 12) == KVBlocks([0, 1, 2])
    assert step(kv, request, 12) == KVBlocks([0, 1, 2, 3, 4, 5])
    # After 24 tokens the next query sees 17..24: logical blocks 1..3 are dropped.
    assert kv.blocks_of("a") == KVBlocks([0, 4, 5], num_dropped_blocks=3)
    assert step(kv, request, 12) == KVBlocks([0, 4, 5, 6, 7, 8], num_dropped_blocks=3)
    assert step(kv, request, 5) == KVBlocks([0, 7, 8, 9, 10], num_dropped_blocks=6)
    assert kv.blocks_of("a") == KVBlocks([0, 8, 9, 10], num_dropped_blocks=7)
    assert kv.max_blocks_held(10_000) == WINDOW.max_blocks == 7
    kv.check_integrity()
    kv.free("a")
    assert kv.usage().num_blocks_free == 16


def test_a_fork_of_a_slid_table_copies_its_shared_tail() -> None:
    kv = window_kv()
    parent = make_request("a", range(3, 45))
    for num_new_tokens in (12, 12, 12, 5):
        step(kv, parent, num_new_tokens)
    kv.fork("a", "b")
    child = make_request("b", range(3, 45))
    child.num_computed_tokens = parent.num_computed_tokens
    assert kv.blocks_of("b") == KVBlocks([0, 8, 9, 10], num_dropped_blocks=7)
    assert step(kv, child, 1) == KVBlocks([0, 8, 9, 11], num_dropped_blocks=7)
    assert kv.usage().num_copied_blocks == 1
    assert kv.blocks_of("a") == KVBlocks([0, 8, 9, 10], num_dropped_blocks=7)
    kv.check_integrity()
    kv.free("b", finished=False)  # preempted: it comes back from token 0
    assert kv.blocks_of("b") == KVBlocks()
    kv.free("a")
    assert kv.usage().num_blocks_free == 16


def test_the_mode_answers_as_window_mode_and_refuses_a_prefix_cache() -> None:
    kv = window_kv()
    assert (kv.accepts_drafts, kv.unbounded_context, kv.can_fork) == (False, True, True)
    assert kv.capacity_fix == "lower kv_window"
    assert kv.max_chunk(2048) == WINDOW.max_chunk
    with pytest.raises(ValueError, match="window mode caches no prefix blocks"):
        WindowModeKV(KVCacheManager(16, 4, True, "fake-model"), WINDOW)
