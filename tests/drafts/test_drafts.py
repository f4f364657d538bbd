"""Draft tokens: whatever a draft holds, a greedy request's output is the one it has without
it; rejected draft tokens leave no block behind and nothing unverified in the prefix cache.

The tiny random model stands in for breadth (each case runs in milliseconds); every draft is
the request's own greedy output up to a random point, then arbitrary tokens, so acceptance
runs from none to all.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.tiny_models import make_tiny_hf_folder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstack import LLM, SamplingParams
from kvstack.drafts.prompt_lookup import lookup
from kvstack.drafts.state import draft_state
from kvstack.drafts.verify import FIRST_WINDOW, remaining_draft, verify_greedy
from kvstack.errors import InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 256
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


# -- the pure parts ----------------------------------------------------------------------------


def brute_lookup(tokens: list[int], max_draft: int, max_ngram: int, min_ngram: int) -> list[int]:
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + max_draft]
    return []


@given(st.lists(st.integers(0, 5), max_size=40), st.integers(1, 8), st.integers(1, 4))
def test_lookup_copies_what_followed_the_latest_earlier_match(tokens: list[int], k: int,
                                                              min_ngram: int) -> None:
    assert lookup(tokens, k, 4, min_ngram) == brute_lookup(tokens, k, 4, min_ngram)


def test_lookup_is_aligned_to_whole_tokens() -> None:
    # Token 256 is bytes 00 01 00 00: a byte-level search could match across token borders.
    tokens = [1, 256, 65536, 1, 256]
    assert lookup(tokens, 3, 2, 2) == [65536, 1, 256]
    assert lookup([0x01000000, 1, 0, 1], 2, 2, 2) == []


def test_verify_greedy_accepts_the_agreeing_prefix_then_the_models_token() -> None:
    logits = torch.full((4, 10), -1.0)
    for row, token in enumerate([3, 5, 7, 9]):
        logits[row, token] = 1.0
    assert verify_greedy(logits, [3, 5, 7]).token_ids == [3, 5, 7, 9]
    partial = verify_greedy(logits, [3, 6, 7])
    assert (partial.token_ids, partial.num_accepted, partial.num_rejected) == ([3, 5], 1, 2)
    assert verify_greedy(logits[:1], []).token_ids == [3]
    with pytest.raises(ValueError):
        verify_greedy(logits, [3])


def test_remaining_draft_keeps_only_a_continuation() -> None:
    assert remaining_draft([1, 2, 3, 4], [1, 2]) == [3, 4]
    assert remaining_draft([1, 2, 3, 4], [1, 5]) == []
    assert remaining_draft([1, 2], [1, 2, 9]) == []


# -- the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_folder(tmp_path_factory.mktemp("drafts"), "gqa")


def engine(tiny: Path, **kwargs: Any) -> LLM:
    kwargs.setdefault("kv_cache_memory", 64 * 2048)  # 64 tokens of 2 KiB: 16 blocks of 4
    kwargs.setdefault("block_size", 4)
    return LLM(str(tiny), skip_tokenizer_init=True, **kwargs)


@pytest.fixture(scope="module")
def plain(tiny: Path) -> Iterator[LLM]:
    yield engine(tiny, enable_prefix_caching=False)


def reference(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids


def published_hashes_are_verified(llm: LLM, sequences: list[list[int]]) -> None:
    """Every block in the prefix cache holds tokens some finished sequence really has."""
    kv = llm.engine.kv_manager
    assert kv is not None
    allowed = {h for seq in sequences for h in kv.prefix_hashes(seq, None)}
    cached = {b.block_hash for b in kv.pool.blocks if b.block_hash is not None}
    assert cached <= allowed


def assert_idle(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.stats().num_blocks_used == 0 and not llm.engine.requests


PROMPT = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=24)


@pytest.mark.parametrize("kwargs", [
    {"enable_prefix_caching": True},
    {"enable_prefix_caching": False},
    {"kv_cache_dtype": "int8"},
    {"max_num_batched_tokens": 8},  # long prompts are chunked; drafts ride the last chunk
], ids=["prefix-cache", "no-prefix-cache", "int8-kv", "chunked"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_draft_gives_the_greedy_output(tiny: Path, plain: LLM, kwargs: dict[str, Any],
                                           data: st.DataObject) -> None:
    llm = _cached_engine(tiny, kwargs)
    llm.reset_prefix_cache()  # each example judges only the blocks it publishes itself
    prompt = data.draw(PROMPT)
    truth = reference(plain if "kv_cache_dtype" not in kwargs else llm, prompt)
    keep = data.draw(st.integers(0, MAX_TOKENS))
    tail = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=MAX_TOKENS))
    draft = truth[:keep] + tail
    out = llm.generate({"prompt_token_ids": prompt, "draft_token_ids": draft}, GREEDY)[0]
    assert out.outputs[0].token_ids == truth
    assert out.num_accepted_tokens <= out.num_draft_tokens
    assert_idle(llm)
    published_hashes_are_verified(llm, [prompt + truth])


_ENGINES: dict[str, LLM] = {}


def _cached_engine(tiny: Path, kwargs: dict[str, Any]) -> LLM:
    key = repr(sorted(kwargs.items()))
    if key not in _ENGINES:
        _ENGINES[key] = engine(tiny, **kwargs)
    return _ENGINES[key]


def test_a_right_draft_takes_a_step_per_window(tiny: Path, plain: LLM) -> None:
    llm = engine(tiny)
    prompt = [5, 6, 7, 8, 9]
    truth = reference(plain, prompt)
    request = llm.engine.add_request(prompt, GREEDY, draft_token_ids=truth)
    drafts = draft_state(request)  # the request's draft state (`drafts/state.py`)
    first = llm.engine.step()  # the prefill verifies the first window of the draft
    assert first[0].outputs[0].token_ids == truth[:FIRST_WINDOW + 1]
    assert drafts.draft_window == 2 * FIRST_WINDOW  # all accepted: the window doubles
    second = llm.engine.step()  # the rest of the draft (it fits the doubled window)
    assert second[0].outputs[0].token_ids == truth
    # Each step adds the model's own token after the accepted ones: 2 steps, 12 tokens.
    assert request.finished and drafts.num_accepted_tokens == MAX_TOKENS - 2
    assert_idle(llm)


def test_a_finished_request_drops_what_is_left_of_its_draft(tiny: Path) -> None:
    llm = _cached_engine(tiny, {})
    request = llm.engine.add_request([5, 6, 7], GREEDY, draft_token_ids=[3, 4, 5])
    drafts = draft_state(request)  # the request's draft state (`drafts/state.py`)
    assert drafts.draft_token_ids == [3, 4, 5]
    llm.engine.abort(request.request_id)  # never stepped: the whole draft is left
    assert request.finished and drafts.draft_token_ids == []  # dropped by the on_finish hook
    assert_idle(llm)


def test_a_wrong_draft_costs_one_window(tiny: Path, plain: LLM) -> None:
    llm = engine(tiny)
    prompt = [5, 6, 7, 8, 10]
    truth = reference(plain, prompt)
    wrong = [(t + 1) % VOCAB for t in truth]
    request = llm.engine.add_request(prompt, GREEDY, draft_token_ids=wrong)
    drafts = draft_state(request)  # the request's draft state (`drafts/state.py`)
    llm.engine.step()
    assert drafts.num_draft_tokens == FIRST_WINDOW and drafts.num_accepted_tokens == 0
    assert drafts.draft_token_ids == []  # the rest of a rejected draft is dropped
    while not request.finished:
        llm.engine.step()
    assert request.output_token_ids == truth and drafts.num_draft_tokens == FIRST_WINDOW
    assert_idle(llm)


def test_drafts_in_a_batch_with_plain_and_sampled_requests(tiny: Path, plain: LLM) -> None:
    llm = engine(tiny, kv_cache_memory=256 * 2048)
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(4)]
    truths = [reference(plain, p) for p in prompts]
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": prompts[3]}, sampled)[0].outputs[0].token_ids
    requests = [
        {"prompt_token_ids": prompts[0], "draft_token_ids": truths[0][:5] + [1, 2]},
        {"prompt_token_ids": prompts[1]},
        {"prompt_token_ids": prompts[2], "draft_token_ids": truths[2]},
        {"prompt_token_ids": prompts[3], "draft_token_ids": truths[2]},  # sampled: ignored
    ]
    outs = llm.generate(requests, [GREEDY, GREEDY, GREEDY, sampled])
    assert [o.outputs[0].token_ids for o in outs[:3]] == truths[:3]
    assert outs[3].outputs[0].token_ids == alone and outs[3].num_draft_tokens == 0
    assert outs[0].num_accepted_tokens >= 5
    assert_idle(llm)


def test_drafts_under_preemption(tiny: Path, plain: LLM) -> None:
    # 10 blocks of 4 tokens for 4 requests of up to 20 tokens each: some are preempted.
    llm = engine(tiny, kv_cache_memory=40 * 2048)
    prompts = [[40 + i] * 8 for i in range(4)]
    truths = [reference(plain, p) for p in prompts]
    drafts = [truths[0], truths[1][:3] + [0] * 6, [], truths[3][:8]]
    outs = llm.generate([{"prompt_token_ids": p, "draft_token_ids": d}
                         for p, d in zip(prompts, drafts, strict=True)], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == truths
    assert llm.stats().num_preemptions > 0
    assert_idle(llm)
    published_hashes_are_verified(llm, [p + t for p, t in zip(prompts, truths, strict=True)])


def test_prompt_lookup_drafts_from_the_prompt(tiny: Path, plain: LLM) -> None:
    llm = engine(tiny, kv_cache_memory=256 * 2048)
    truth = reference(plain, [9, 8, 7, 6], SamplingParams(temperature=0, max_tokens=8,
                                                          ignore_eos=True))
    # The prompt already holds the greedy continuation of its last tokens: a perfect quote.
    prompt = [9, 8, 7, 6] + truth + [3, 9, 8, 7, 6]
    expected = reference(plain, prompt)
    lookup_params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                   prompt_lookup=6)
    out = llm.generate({"prompt_token_ids": prompt}, lookup_params)[0]
    assert out.outputs[0].token_ids == expected
    assert out.num_draft_tokens > 0
    if expected[:8] == truth:
        assert out.num_accepted_tokens >= 6
    assert_idle(llm)


def test_bad_drafts_are_refused_or_ignored(tiny: Path, plain: LLM) -> None:
    llm = engine(tiny)
    prompt = [11, 12, 13]
    truth = reference(plain, prompt)
    with pytest.raises(InvalidRequestError, match="draft_token_ids") as err:
        llm.generate({"prompt_token_ids": prompt, "draft_token_ids": [3, VOCAB]}, GREEDY)
    assert len(str(err.value).splitlines()) == 1
    with pytest.raises(InvalidRequestError, match="draft_token_ids"):
        llm.generate({"prompt_token_ids": prompt, "draft_token_ids": 7}, GREEDY)
    empty = llm.generate({"prompt_token_ids": prompt, "draft_token_ids": []}, GREEDY)[0]
    assert empty.outputs[0].token_ids == truth and empty.num_draft_tokens == 0
    longer = llm.generate({"prompt_token_ids": prompt, "draft_token_ids": truth * 20},
                          GREEDY)[0]
    assert longer.outputs[0].token_ids == truth
    assert longer.num_draft_tokens <= MAX_TOKENS - 1  # cut to what max_tokens leaves room for
    assert_idle(llm)
