"""Where a request's tokens came from (`RequestOutput.provenance`) and the engine's cache
snapshot, on a tiny random-weight model: prefix cache, a disk tier in a fresh engine, verified
drafts, and a snapshot that agrees with `stats()`."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.tiny_models import make_tiny_hf_folder

from kvstack import LLM, SamplingParams
from kvstack.kv.snapshot import CACHED, FREE, IN_USE, PINNED, RESTORED
from kvstack.outputs import COMPUTED, DRAFT, MODEL, PREFIX_CACHE, TIER

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(10, 60))  # 50 tokens: 3 full blocks of 16, then 2


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), "gqa")


def tiny_llm(folder: Path, **kwargs: object) -> LLM:
    return LLM(model=str(folder), skip_tokenizer_init=True, kv_cache_memory="256KiB", **kwargs)


def test_prompt_provenance_cold_then_from_the_prefix_cache(tiny_folder: Path) -> None:
    llm = tiny_llm(tiny_folder)
    cold = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
    assert cold.provenance.prompt == ((COMPUTED, 50),)
    assert cold.provenance.output == ((MODEL, 6),)
    warm = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
    assert warm.provenance.prompt == ((PREFIX_CACHE, 48), (COMPUTED, 2))
    assert warm.provenance.num_prompt(PREFIX_CACHE) == warm.num_cached_tokens == 48
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    # Partial outputs carry the provenance as it stands.
    outs = list(llm.stream({"prompt_token_ids": PROMPT + [1]}, GREEDY))
    assert [o.provenance.output for o in outs[:2]] == [((MODEL, 1),), ((MODEL, 2),)]
    assert outs[0].provenance.prompt == ((PREFIX_CACHE, 48), (COMPUTED, 3))
    llm.engine.check_integrity()


def test_tier_restored_tokens_in_a_fresh_engine(tiny_folder: Path, tmp_path: Path) -> None:
    first = tiny_llm(tiny_folder, kv_disk_dir=tmp_path)
    first.generate({"prompt_token_ids": PROMPT}, GREEDY)
    assert first.engine.flush_tiers(60)
    snap = first.cache_snapshot()
    assert snap is not None and {snap.tiers[i] for i in snap.published} == {("disk",)}
    first.close()
    fresh = tiny_llm(tiny_folder, kv_disk_dir=tmp_path)
    out = fresh.generate({"prompt_token_ids": PROMPT + [7, 7]}, GREEDY)[0]
    assert out.provenance.prompt == ((TIER, 48), (COMPUTED, 4))
    snap = fresh.cache_snapshot()
    assert snap is not None
    restored = [b for b in snap.published.values() if b.origin == RESTORED]
    assert sorted(b.token_ids[0] for b in restored) == [10, 26, 42]
    assert all(snap.tiers[i] == ("disk",) for i, b in snap.published.items()
               if b.origin == RESTORED)
    again = fresh.generate({"prompt_token_ids": PROMPT + [8]}, GREEDY)[0]
    assert again.provenance.prompt == ((PREFIX_CACHE, 48), (COMPUTED, 3))
    fresh.engine.check_integrity()
    fresh.close()


def test_verified_drafts_are_marked_in_the_output(tiny_folder: Path) -> None:
    llm = tiny_llm(tiny_folder)
    truth = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids
    # The model's own first four tokens, then two wrong ones: four accepted, then the model.
    draft = truth[:4] + [(truth[4] + 1) % 256, 3]
    out = llm.generate({"prompt_token_ids": PROMPT, "draft_token_ids": draft}, GREEDY)[0]
    assert out.outputs[0].token_ids == truth
    assert out.provenance.output == ((DRAFT, 4), (MODEL, 2))
    assert out.provenance.num_output(DRAFT) == out.num_accepted_tokens == 4
    llm.engine.check_integrity()


def test_snapshot_agrees_with_stats_while_requests_run(tiny_folder: Path) -> None:
    llm = tiny_llm(tiny_folder)
    engine = llm.engine
    engine.add_request(PROMPT, GREEDY, request_id="a", cache_salt="s1")
    engine.add_request(list(range(100, 140)), GREEDY, request_id="b")
    engine.step()
    for _ in range(3):
        snap, stats = llm.cache_snapshot(), llm.stats()
        assert snap is not None
        assert snap.count(IN_USE) + snap.count(PINNED) == stats.num_blocks_used
        assert snap.count(CACHED) == stats.num_blocks_cached
        assert snap.count(FREE) + snap.count(CACHED) == stats.num_blocks_free
        assert set(snap.request_salts.items()) == {("a", "s1"), ("b", None)}
        assert {r for ids in snap.holders.values() for r in ids} == {"a", "b"}
        engine.step()
    while engine.has_unfinished():
        engine.step()
    snap = llm.cache_snapshot()
    assert snap is not None and snap.count(IN_USE) == 0 and not snap.holders
    assert {b.cache_salt for b in snap.published.values()} == {"s1", None}
    engine.check_integrity()
