"""Prompt scores kept beside the prefix cache (`scoring/`): a scored prompt whose context is
cached computes only the rest, and its numbers equal a cold engine's -- at block boundaries,
chunked, hybrid (Gemma 3) and after a tier restore; scores leave with evicted blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.tiny_gemma3 import make_tiny_gemma3_folder
from helpers.tiny_models import make_tiny_hf_folder

from kvstack import LLM, SamplingParams
from kvstack.outputs import RequestOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCORE = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_folder(tmp_path_factory.mktemp("scoring"), "gqa",
                               max_position_embeddings=512)


def _llm(folder: Path, **kw: Any) -> LLM:
    return LLM(str(folder), skip_tokenizer_init=True, **kw)


def _score(llm: LLM, ids: list[int], params: SamplingParams = SCORE) -> RequestOutput:
    return llm.generate({"prompt_token_ids": ids}, params)[0]


def _assert_same(got: RequestOutput, want: RequestOutput) -> None:
    """Same prompt tokens scored, same alternatives and ranks, log-probs within 1e-4."""
    assert got.prompt_logprobs is not None and want.prompt_logprobs is not None
    assert got.prompt_logprobs[0] is None and want.prompt_logprobs[0] is None
    for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
        assert a is not None and b is not None and set(a) == set(b)
        for token in a:
            assert abs(a[token].logprob - b[token].logprob) < 1e-4
            assert a[token].rank == b[token].rank


def _context(n: int, seed: int = 0) -> list[int]:
    return [(seed * 37 + i * 11) % 250 + 3 for i in range(n)]


@pytest.mark.parametrize("context_len, chunk", [(80, None), (73, None), (80, 24)])
def test_cached_context_is_not_recomputed_and_scores_equal_a_cold_engine(
        tiny: Path, context_len: int, chunk: int | None) -> None:
    kw: dict[str, Any] = {"max_num_batched_tokens": chunk} if chunk else {}
    cached = _llm(tiny, kv_cache_memory="8MiB", block_size=16, **kw)
    cold = _llm(tiny, kv_cache_memory="8MiB", block_size=16, enable_prefix_caching=False)
    context = _context(context_len)
    for i, tail in enumerate([[5, 6, 7], [9], [11, 12, 13, 14, 15, 16, 17], [21, 22]]):
        got = _score(cached, context + tail)
        # The first computes everything; each later one hits the context's full blocks.
        assert got.num_cached_tokens == (0 if i == 0 else context_len // 16 * 16)
        _assert_same(got, _score(cold, context + tail))
    cached.engine.check_integrity()
    assert cached.stats().num_blocks_used == 0


def test_only_blocks_scored_before_are_taken(tiny: Path) -> None:
    llm = _llm(tiny, kv_cache_memory="8MiB", block_size=16)
    ids = _context(70, seed=3)
    llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1))  # caches, no scores
    first = _score(llm, ids)
    second = _score(llm, ids)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 64
    _assert_same(second, first)
    # A non-scoring request still takes the whole hit.
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1))[0]
    assert plain.num_cached_tokens == 64
    llm.engine.check_integrity()


def test_scores_leave_with_evicted_blocks(tiny: Path) -> None:
    llm = _llm(tiny, kv_cache_memory="1MiB", block_size=16)
    store = llm.engine.scores
    for seed in range(12):  # far more prompts than the pool holds
        _score(llm, _context(64, seed=seed))
        llm.engine.check_integrity()  # every entry's block is still cached
    assert 0 < len(store) < 12 * 4
    assert len(store) <= llm.stats().num_blocks_cached
    llm.reset_prefix_cache()
    assert len(store) == 0 and store.nbytes == 0


def test_parallel_samples_share_the_prompts_scores(tiny: Path) -> None:
    llm = _llm(tiny, kv_cache_memory="8MiB", block_size=16)
    ids = _context(40, seed=5)
    params = SamplingParams(max_tokens=3, n=2, seed=1, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": ids}, params)[0]
    assert len(out.outputs) == 2
    _assert_same(out, _score(_llm(tiny, kv_cache_memory="8MiB", block_size=16,
                                 enable_prefix_caching=False), ids,
                             SamplingParams(max_tokens=1, prompt_logprobs=2)))
    llm.engine.check_integrity()


def test_tier_restored_blocks_are_scored_again_then_kept(tiny: Path, tmp_path: Path) -> None:
    ids = _context(64 + 9, seed=7)
    with _llm(tiny, kv_cache_memory="8MiB", block_size=16,
             kv_disk_dir=str(tmp_path)) as writer:
        want = _score(writer, ids)
    with _llm(tiny, kv_cache_memory="8MiB", block_size=16,
             kv_disk_dir=str(tmp_path)) as reader:
        # The disk holds K/V but no scores: nothing of it is taken, the numbers are exact.
        first = _score(reader, ids)
        assert first.num_cached_tokens == 0
        _assert_same(first, want)
        plain = reader.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1))[0]
        assert plain.num_cached_tokens == 64
        again = _score(reader, ids)
        assert again.num_cached_tokens == 64
        _assert_same(again, want)
        reader.engine.check_integrity()


def test_gemma3_hybrid_layout_scores_with_the_cache(tmp_path: Path) -> None:
    folder = make_tiny_gemma3_folder(tmp_path, "mqa")
    cached = _llm(folder, kv_cache_memory="8MiB", block_size=4)
    cold = _llm(folder, kv_cache_memory="8MiB", block_size=4, enable_prefix_caching=False)
    context = _context(30, seed=9)
    for i, tail in enumerate([[4, 5], [6, 7, 8]]):
        got = _score(cached, context + tail)
        assert (got.num_cached_tokens > 0) == (i > 0)
        _assert_same(got, _score(cold, context + tail))
    cached.engine.check_integrity()
