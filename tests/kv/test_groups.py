"""Attention groups of a hybrid model, and what a window group can still reach."""

from __future__ import annotations

from kvstack.kv.groups import AttentionGroup, attention_groups

GEMMA3_270M = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))


def test_gemma3_layers_group_by_window() -> None:
    groups = attention_groups(GEMMA3_270M)
    assert groups == [AttentionGroup(None, (5, 11, 17)),
                      AttentionGroup(512, tuple(i for i in range(18) if (i + 1) % 6))]
    assert [g.name for g in groups] == ["full", "sliding 512"]
    assert attention_groups([None, None]) == [AttentionGroup(None, (0, 1))]


def test_a_window_group_reaches_the_window_plus_one_block() -> None:
    full, sliding = attention_groups(GEMMA3_270M)
    assert full.blocks_reachable(8192, 16) == 512
    assert sliding.blocks_reachable(8192, 16) == 33  # 32 blocks of window, the query's own
    assert sliding.blocks_reachable(100, 16) == 7  # shorter than the window: every block
    # 3 of 18 layers keep everything: 3 * 512 + 15 * 33 layer-blocks vs 18 * 512, 4.5x.
    kept = 3 * 512 + 15 * 33
    assert round(18 * 512 / kept, 1) == 4.5
