"""The hybrid KV layout (`kv/groups.py`, `kv/coordinator.py`) without a model: how layers share
pages, window groups freeing what slid out, prefix hits that need each group's last window
before the hit point, forks, drafts trimmed, preemption, and the pool's integrity after each."""

from __future__ import annotations

import pytest
from helpers.kv_requests import make_request, prefill

from kvstack.kv.block_pool import KVBlock
from kvstack.kv.coordinator import KVCacheCoordinator
from kvstack.kv.group_tables import group_hash
from kvstack.kv.groups import KVLayout
from kvstack.kv.manager import KVCacheManager

GEMMA3_270M = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
# Like the tiny Gemma 3 of the model tests: window 8 under 4-token blocks.
TINY = (8, None, 8, 8, 8, None)
BS = 4


def test_gemma3_pages_hold_three_layers_in_six_groups() -> None:
    layout = KVLayout.hybrid(GEMMA3_270M)
    assert layout.page_layers == 3 and layout.num_groups == 6 and layout.is_hybrid
    assert layout.groups[0].window is None and layout.groups[0].layers == (5, 11, 17)
    assert [g.layers for g in layout.groups[1:]] == [(0, 1, 2), (3, 4, 6), (7, 8, 9),
                                                     (10, 12, 13), (14, 15, 16)]
    assert layout.tensor_of_layer()[:7] == (0, 1, 2, 0, 1, 0, 2)
    assert layout.group_of_layer()[:7] == (1, 1, 1, 2, 2, 0, 2)
    assert layout.layer_windows() == GEMMA3_270M
    # At 8,192 tokens: 512 blocks for the full group, 33 for each window group.
    assert layout.blocks_held(8192, 16) == 512 + 5 * 33
    assert 6 * 512 / layout.blocks_held(8192, 16) > 4
    # A model of one attention type, or int4 storage: one group of every layer.
    assert not KVLayout.hybrid((None,) * 4).is_hybrid
    assert KVLayout.of(GEMMA3_270M, "int4") == KVLayout.single(18)


def test_a_type_that_does_not_divide_leaves_its_last_group_short() -> None:
    layout = KVLayout.hybrid((None, 8, 8, None, 8))
    assert layout.page_layers == 2
    assert [(g.window, g.layers) for g in layout.groups] == [(None, (0, 3)), (8, (1, 2)),
                                                              (8, (4,))]


def hybrid(num_blocks: int = 64, max_chunk_tokens: int = 0) -> KVCacheCoordinator:
    return KVCacheCoordinator(KVCacheManager(num_blocks, BS, True, "fake-model"),
                              KVLayout.hybrid(TINY), max_chunk_tokens)


def held(kv: KVCacheCoordinator, request_id: str) -> list[int]:
    """Blocks the request holds per group, group 0 first."""
    return [len(kv.block_ids(request_id))] + [len(r) for r in kv.groups.held(request_id)]


def test_window_groups_free_what_slid_out_as_the_sequence_grows() -> None:
    kv = hybrid()
    request = prefill(kv, "a", list(range(40)))
    # The prefill step wrote all 10 blocks in every group; after it, a window group keeps the
    # blocks from position 40 - 8 + 1 = 33 on: blocks 8 and 9.
    assert held(kv, "a") == [10, 10, 10]
    kv.slide_window(request)
    assert held(kv, "a") == [10, 2, 2]
    assert kv.group_block_ids("a")[0][:8] == [0] * 8  # placeholders where blocks slid out
    kv.check_integrity()
    for _ in range(30):  # decode: one token a step, as the scheduler drives it
        request.output_token_ids.append(7)
        assert kv.allocate(request, 1)
        request.num_computed_tokens += 1
        kv.cache_computed_blocks(request)
        kv.slide_window(request)
        n = request.num_computed_tokens
        assert held(kv, "a")[1:] == [-(-n // BS) - (n - 7) // BS] * 2
        assert max(held(kv, "a")[1:]) <= 3  # ceil(8 / 4) + 1: what the estimate counts
        kv.check_integrity()
    kv.free("a")
    kv.check_integrity()
    assert kv.pool.num_free == kv.num_blocks


def test_a_hit_needs_every_group_s_last_window_before_it() -> None:
    kv = hybrid()
    prompt = list(range(40))
    first = prefill(kv, "a", prompt)
    kv.slide_window(first)
    kv.free("a")
    hashes = kv.prefix_hashes(prompt, None)
    # Shares 37 tokens: a hit of 9 blocks (36 tokens) needs blocks 7 and 8 (positions 29..35)
    # of each window group, which slid out of "a"'s window but stay cached.
    probe = make_request("b", prompt[:37] + [999] * 3)
    hit = kv.match_prefix(probe)
    assert hit.num_tokens == 36
    present = [[b is not None for b in row] for row in hit.group_blocks]
    assert present == [[False] * 7 + [True] * 2] * 2
    # Evict group 1's block 8 alone (everything else needed is held meanwhile): the hit falls
    # back to 8 blocks, whose window (blocks 6 and 7) every group still has.
    target = kv.pool.lookup(group_hash(hashes[8], 1))
    assert target is not None
    wanted = hashes + [group_hash(hashes[j], g) for g in (1, 2) for j in (6, 7, 8)]
    keep: list[KVBlock] = [b for h in wanted for b in [kv.pool.lookup(h)]
                           if b is not None and b is not target]
    kv.pool.touch(keep)
    kv.reset_prefix_cache()
    kv.pool.free(keep)
    assert kv.pool.lookup(group_hash(hashes[8], 1)) is None
    hit = kv.match_prefix(probe)
    assert hit.num_tokens == 32
    assert all(row[6] is not None and row[7] is not None for row in hit.group_blocks)
    # Admitted with that hit, the request computes from token 32 with every table in place.
    assert kv.allocate(probe, 40 - 32, hit)
    assert held(kv, "b") == [10, 4, 4]
    kv.check_integrity()
    kv.free("b")
    kv.check_integrity()


def test_preemption_keeps_hashes_and_a_fork_shares_every_group() -> None:
    kv = hybrid()
    request = prefill(kv, "a", list(range(22)))
    kv.slide_window(request)
    kv.fork("a", "c")
    kv.check_integrity()
    shared = kv.groups.held("a")[0][-1]
    assert shared.ref_cnt == 2
    # The child's first write into the shared, partly filled tail copies it in every group.
    child = make_request("c", list(range(22)))
    child.num_computed_tokens = 22
    before = kv.num_copied_blocks
    assert kv.allocate(child, 1)
    assert kv.num_copied_blocks == before + 3  # group 0's tail and each window group's
    kv.check_integrity()
    kv.free("c")
    kv.free("a", finished=False)
    kv.check_integrity()
    assert kv.pool.num_free == kv.num_blocks and kv.block_hashes("a")


def test_trim_frees_every_group_s_blocks_past_the_accepted_tokens() -> None:
    kv = hybrid()
    request = prefill(kv, "a", list(range(16)))
    kv.slide_window(request)
    assert kv.allocate(request, 9)  # a decode step with 8 draft tokens: blocks up to 25
    assert held(kv, "a") == [7, 5, 5]
    request.num_computed_tokens += 2  # one draft token accepted, plus the model's own
    kv.trim(request)
    assert held(kv, "a") == [5, 3, 3]
    kv.check_integrity()


@pytest.mark.parametrize("num_blocks", [20, 24])
def test_growth_that_does_not_fit_changes_nothing(num_blocks: int) -> None:
    kv = hybrid(num_blocks)
    request = make_request("a", list(range(40)))
    fits = kv.allocate(request, 40)  # 10 blocks in each of 3 groups while the prefill runs
    assert fits is False
    assert kv.pool.num_free == num_blocks and not kv.block_ids("a")
    kv.check_integrity()


def test_a_single_type_model_keeps_the_classic_manager() -> None:
    kv = KVCacheCoordinator(KVCacheManager(16, BS, True, "fake-model"))
    assert kv.group_block_ids("x") == []
    assert kv.max_blocks_held(40) == 10
    assert hybrid().max_blocks_held(40) == 10 + 2 * 3  # one token a step: the window's
    chunked = hybrid(64, max_chunk_tokens=16)
    assert chunked.max_blocks_held(40) == 10 + 2 * 7  # ceil((8 - 1 + 16) / 4) + 1


def test_a_pinned_prefix_keeps_every_group_s_last_window() -> None:
    """A pin (Anthropic cache_control) holds group 0's run and each window group's last window
    before its end: after everything else is evicted, the pinned prefix still hits in full."""
    kv = hybrid()
    prompt = list(range(40))
    request = prefill(kv, "a", prompt)
    kv.slide_window(request)
    kv.free("a")
    assert kv.pin_prefix(prompt[:36], None, until=1e18) == (36, 0)
    assert len(kv.pins) == 9 + 2 * 2  # 9 blocks of group 0, blocks 7 and 8 of each window group
    kv.reset_prefix_cache()
    hit = kv.match_prefix(make_request("b", prompt[:37] + [5, 6, 7]))
    assert hit.num_tokens == 36
    kv.check_integrity()


def test_admission_never_hands_out_a_hit_block_of_another_group() -> None:
    """A window group's hit blocks sit early in the free queue (they slid out while their
    request ran) while later frees put many blocks behind them: growing the other groups
    must not evict and hand them out before the hit takes them."""
    kv = hybrid(150)  # "a" takes 30, "d" the other 120: no block is left unused
    prompt = list(range(40))
    first = prefill(kv, "a", prompt)
    kv.slide_window(first)  # window blocks 0..7 of groups 1 and 2 go to the free queue
    other = prefill(kv, "d", [1000 + i for i in range(160)])
    kv.free("d")  # 120 blocks freed behind them, and "a"'s own after those
    kv.free("a")
    probe = make_request("b", prompt[:37] + [999] * 63)  # a 36-token hit, 100 tokens in all
    hit = kv.match_prefix(probe)
    assert hit.num_tokens == 36 and other.num_computed_tokens == 160
    assert kv.allocate(probe, 100 - 36, hit)
    kv.check_integrity()  # a block in two tables would have two holders and one reference
    rows = kv.groups.held("b")
    assert all(row[0] is block for row, block in zip(rows, [r[7] for r in hit.group_blocks],
                                                     strict=True))
