"""How a hybrid model's cache budget splits: live states, snapshots, K/V blocks."""

from __future__ import annotations

from dataclasses import dataclass

from kvstack.errors import InvalidRequestError


@dataclass(frozen=True)
class StateBudget:
    live_bytes: int  # every running sequence's states (max_num_seqs of them)
    snapshot_bytes: int  # the cap on kept snapshots
    kv_bytes: int  # what is left for the attention layers' K/V blocks


def split_budget(total: int, state_nbytes: int, max_num_seqs: int) -> StateBudget:
    """The live states first (each running sequence holds one), then the rest in halves:
    snapshots, K/V. A snapshot is as useful as the K/V blocks up to it, so neither side
    starves the other."""
    live = state_nbytes * max_num_seqs
    rest = total - live
    if rest < 2 * state_nbytes:
        raise InvalidRequestError(
            f"kv_cache_memory {total} B does not hold {max_num_seqs} sequences' recurrent "
            f"state ({state_nbytes} B each) plus a snapshot and K/V; raise kv_cache_memory "
            "or lower max_num_seqs")
    return StateBudget(live, rest // 2, rest - rest // 2)


def snapshot_every(state_nbytes: int, kv_block_bytes: int, requested: int) -> int:
    """Blocks between periodic snapshots: `requested`, or (0) the fewest blocks whose K/V
    bytes reach one snapshot's, so periodic snapshots cost at most the K/V they cover."""
    if requested > 0:
        return requested
    return max(1, -(-state_nbytes // max(kv_block_bytes, 1)))
