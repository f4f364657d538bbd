"""Blocks shared between block tables (parallel samples): `fork` shares by reference count,
the first write into a shared, partly filled block copies it (copy-on-write), integrity counts
every holder, and every KV dtype's storage copies a block exactly (scales and int4's
full-precision window included)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kvstack.config import ModelConfig
from kvstack.kv.block_pool import BlockPool
from kvstack.kv.manager import KVCacheManager
from kvstack.kv.storage import make_kv_storage

BS = 4


@dataclass
class FakeRequest:
    """What the manager reads of a request (`KVRequest`)."""

    request_id: str
    tokens: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    scores_prompt: bool = False
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_ids(self) -> list[int]:
        return list(self.tokens)

    def tokens_between(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def manager(num_blocks: int = 16) -> tuple[KVCacheManager, list[tuple[int, int]]]:
    copies: list[tuple[int, int]] = []
    kv = KVCacheManager(num_blocks, BS, True, "fake-model",
                        on_copy=lambda src, dst: copies.append((src, dst)))
    return kv, copies


def prefilled(kv: KVCacheManager, num_prompt: int) -> FakeRequest:
    """A request whose prompt is computed and published (as after its prefill step)."""
    parent = FakeRequest("p", list(range(num_prompt)))
    assert kv.allocate(parent, num_prompt)
    parent.num_computed_tokens = num_prompt
    kv.cache_computed_blocks(parent)
    return parent


def test_fork_shares_every_block_and_integrity_counts_each_holder() -> None:
    kv, copies = manager()
    parent = prefilled(kv, 10)  # 2 full blocks + 2 tokens in the third
    for i in range(3):
        kv.fork("p", f"c{i}")
    assert all(kv.block_ids(f"c{i}") == kv.block_ids("p") for i in range(3))
    assert [b.ref_cnt for b in kv.blocks("p")] == [4, 4, 4]
    assert kv.pool.num_in_use == 3 and not copies
    kv.check_integrity()
    kv.free("p")
    assert [b.ref_cnt for b in kv.blocks("c0")] == [3, 3, 3]
    kv.check_integrity()
    del parent


def test_first_write_into_the_shared_tail_copies_it_and_the_last_holder_writes_in_place() -> None:
    kv, copies = manager()
    prefilled(kv, 10)
    children = [FakeRequest(f"c{i}", list(range(10)) + [99], 10) for i in range(3)]
    for child in children:
        kv.fork("p", child.request_id)
    tail = kv.blocks("p")[2]
    for i, child in enumerate(children):
        assert kv.allocate(child, 1)
        blocks = kv.blocks(child.request_id)
        assert blocks[:2] == kv.blocks("p")[:2], "full blocks stay shared"
        assert blocks[2] is not tail and blocks[2].ref_cnt == 1
        assert copies[-1] == (tail.block_id, blocks[2].block_id)
        assert tail.ref_cnt == 3 - i
        kv.check_integrity()
    parent = FakeRequest("p", list(range(10)) + [7], 10)
    assert kv.allocate(parent, 1)  # the last holder of the tail: no copy
    assert kv.blocks("p")[2] is tail and tail.ref_cnt == 1
    assert len(copies) == kv.num_copied_blocks == kv.usage().num_copied_blocks == 3
    for request in (parent, *children):
        kv.free(request.request_id)
    assert kv.pool.num_in_use == 0
    kv.check_integrity()


def test_a_fork_at_a_block_boundary_copies_nothing() -> None:
    kv, copies = manager()
    prefilled(kv, 8)  # exactly two full blocks
    child = FakeRequest("c", list(range(8)) + [1], 8)
    kv.fork("p", "c")
    assert kv.allocate(child, 1)
    assert not copies and len(kv.blocks("c")) == 3 and kv.blocks("c")[2].ref_cnt == 1


def test_a_copy_that_does_not_fit_fails_and_changes_nothing() -> None:
    kv, copies = manager(num_blocks=3)
    prefilled(kv, 10)  # all 3 blocks in use
    child = FakeRequest("c", list(range(11)), 10)
    kv.fork("p", "c")
    before = kv.block_ids("c")
    assert not kv.allocate(child, 1)
    assert kv.block_ids("c") == before and not copies
    kv.check_integrity()


def test_integrity_catches_a_reference_no_table_explains() -> None:
    kv, _ = manager()
    prefilled(kv, 10)
    kv.fork("p", "c")
    kv.pool.blocks[kv.block_ids("p")[0]].ref_cnt += 1
    with pytest.raises(AssertionError, match="references but"):
        kv.check_integrity()


def test_pool_frees_a_shared_block_only_after_its_last_holder() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.touch([block])
    pool.free([block])
    assert pool.num_free == 1 and block.ref_cnt == 1
    pool.free([block])
    assert pool.num_free == 2


MODEL = ModelConfig("LlamaForCausalLM", vocab_size=32, hidden_size=8, intermediate_size=16,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, max_model_len=64)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8", "int4"])
def test_storage_copies_a_partly_filled_block_exactly(kv_dtype: str) -> None:
    storage = make_kv_storage(MODEL, 4, 16, kv_dtype, torch.float32, max_num_seqs=4)
    g = torch.Generator().manual_seed(0)
    slots = torch.arange(16, 16 + 10)  # block 1, 10 of its 16 slots: partly filled
    for layer in range(MODEL.num_layers):
        storage.write(layer, slots, torch.randn(10, 2, 64, generator=g),
                      torch.randn(10, 2, 64, generator=g))
    storage.copy_block(1, 3)
    copied = torch.arange(48, 48 + 10)
    for layer in range(MODEL.num_layers):
        for a, b in zip(storage.read(layer, slots), storage.read(layer, copied), strict=True):
            assert torch.equal(a, b)
    # The copy goes on filling on its own: the original keeps its tokens.
    for layer in range(MODEL.num_layers):
        storage.write(layer, torch.tensor([58]), torch.ones(1, 2, 64), torch.ones(1, 2, 64))
    assert not torch.equal(storage.read(0, torch.tensor([58]))[0],
                           storage.read(0, torch.tensor([26]))[0])
    before = storage.read(0, slots)
    assert all(torch.equal(a, b) for a, b in zip(before, storage.read(0, slots), strict=True))
