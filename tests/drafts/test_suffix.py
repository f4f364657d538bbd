"""Suffix drafts: the implicit tree drafts what an explicit count tree would; the global store
keeps its bounds and its tenants apart; through the engine a greedy output is the one it has
without drafts, alone and batched, and a tenant's next request drafts from its last output.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers.tiny_models import make_tiny_hf_folder
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstack import LLM, SamplingParams
from kvstack.config import DraftConfig
from kvstack.drafts.suffix_store import SuffixStore
from kvstack.drafts.suffix_tree import (
    SEPARATOR,
    SuffixDraft,
    SuffixParams,
    TokenHistory,
    speculate,
)
from kvstack.errors import InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 256


# -- the pure parts ----------------------------------------------------------------------------


def brute_speculate(corpus: list[int], context: list[int], max_tokens: int,
                    params: SuffixParams) -> tuple[list[int], float]:
    """The paper's walk over an explicit count tree, match length by match length."""
    context = context[-params.max_depth:]
    n = len(corpus)
    best: tuple[list[int], float] = ([], 0.0)
    for m in range(len(context), 0, -1):
        ends = [p for p in range(m - 1, n - 1) if corpus[p - m + 1:p + 1] == context[-m:]]
        if not ends:
            continue
        limit = min(max_tokens, int(m * params.max_spec_factor + params.max_spec_offset + 1e-6))
        followers, tokens, prob, score = [p + 1 for p in ends], [], 1.0, 0.0
        while len(tokens) < limit:
            followers = [f for f in followers if f < n]
            if not followers:
                break
            counts: dict[int, tuple[int, int]] = {}  # token -> (count, last position)
            for f in followers:
                c, _ = counts.get(corpus[f], (0, -1))
                counts[corpus[f]] = (c + 1, f)
            token = max(counts, key=lambda t: counts[t])
            if token == SEPARATOR:
                break
            prob *= counts[token][0] / len(followers)
            if prob < params.min_token_prob:
                break
            tokens.append(token)
            score += prob
            followers = [f + 1 for f in followers if corpus[f] == token]
        if score > best[1] or (score == best[1] and not best[0]):
            best = (tokens, score)
    return best


SMALL = st.lists(st.integers(0, 3), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(corpus=SMALL, context=st.lists(st.integers(0, 3), min_size=1, max_size=8),
       separators=st.sets(st.integers(0, 59), max_size=4),
       max_tokens=st.integers(1, 10), depth=st.sampled_from([1, 3, 64]),
       factor=st.sampled_from([0.5, 1.0, 3.0]), min_prob=st.sampled_from([0.0, 0.1, 0.6]))
def test_speculate_matches_an_explicit_count_tree(corpus: list[int], context: list[int],
                                                  separators: set[int], max_tokens: int,
                                                  depth: int, factor: float,
                                                  min_prob: float) -> None:
    for i in separators:
        if i < len(corpus):
            corpus[i] = SEPARATOR
    params = SuffixParams(depth, factor, 0.0, min_prob)
    got = speculate(np.array(corpus, dtype=np.int32), np.array(context, dtype=np.int32),
                    max_tokens, params)
    tokens, score = brute_speculate(corpus, context, max_tokens, params)
    assert got.token_ids == tokens
    assert got.score == pytest.approx(score)


def test_a_request_drafts_from_its_own_history_and_the_counts_set_the_length() -> None:
    params = SuffixParams(max_depth=64, max_spec_factor=2.0, min_token_prob=0.3)
    text = [5, 6, 7, 8, 9, 10, 11, 12]
    corpus = np.array(text + [1, 2] + text[:3], dtype=np.int32)  # ends with 5 6 7
    draft = speculate(corpus, corpus, 32, params)
    assert draft.token_ids == [8, 9, 10, 11, 12, 1]  # 2 x 3 matched tokens
    # Two earlier continuations, one twice: the draft goes as far as it has 30% backing.
    corpus = np.array([1, 2, 3, 1, 2, 3, 1, 2, 4, 9, 1, 2], dtype=np.int32)
    draft = speculate(corpus, corpus, 32, params)
    assert draft.token_ids[0] == 3 and draft.score < len(draft.token_ids)
    assert speculate(np.array([1, 2, 3], dtype=np.int32), np.array([4], dtype=np.int32), 8,
                     params).token_ids == []  # no history: no draft


def test_a_draft_is_cut_where_its_expected_tokens_per_step_time_peak() -> None:
    draft = SuffixDraft([1, 2, 3, 4], 2.3, 4, (0.9, 0.8, 0.4, 0.2))
    assert draft.cut_to_cost(0.0) == [1, 2, 3, 4]  # vLLM's behaviour: no cut
    # (1 + 0.9) / 1.5 = 1.27, (1 + 1.7) / 2 = 1.35, (1 + 2.1) / 2.5 = 1.24: two pay best.
    assert draft.cut_to_cost(0.5) == [1, 2]
    assert draft.cut_to_cost(1.0) == []  # no row pays when a row costs a whole step
    assert draft.cut_to_cost(0.05) == [1, 2, 3, 4]


def test_token_history_grows() -> None:
    history = TokenHistory(capacity=4)
    for i in range(100):
        history.extend([i, i])
    assert history.tokens.tolist() == [i for i in range(100) for _ in range(2)]


def test_store_evicts_oldest_first_within_its_bounds_and_keeps_tenants_apart() -> None:
    store = SuffixStore(max_outputs=3, max_tokens=10)
    store.add("a", [1, 2, 3])
    store.add("b", [4, 5, 6])
    store.add("a", [7, 8])
    store.check()
    assert store.corpus("a").tolist() == [1, 2, 3, SEPARATOR, 7, 8, SEPARATOR]
    assert store.corpus("b").tolist() == [4, 5, 6, SEPARATOR]
    store.add("b", [9, 9, 9, 9])  # a 4th output: the oldest goes, and 9 tokens fit
    store.check()
    assert store.corpus("a").tolist() == [7, 8, SEPARATOR]
    assert store.corpus("b").tolist() == [4, 5, 6, SEPARATOR, 9, 9, 9, 9, SEPARATOR]
    store.add("a", [1, 1, 1])  # a 4th output again: [4, 5, 6] goes
    store.check()
    assert store.corpus("a").tolist() == [7, 8, SEPARATOR, 1, 1, 1, SEPARATOR]
    assert store.corpus("b").tolist() == [9, 9, 9, 9, SEPARATOR]
    store.add("c", list(range(25)))  # longer than the whole bound: its last tokens, alone
    store.check()
    assert store.corpus("c").tolist() == list(range(15, 25)) + [SEPARATOR]
    assert store.corpus("a") is None and store.num_tokens == 10
    assert store.drop("c") == 1 and store.drop("c") == 0
    store.check()
    assert store.num_outputs == 0 and store.num_tokens == 0
    SuffixStore(0, 0).add("a", [1])  # keeping nothing is no error


def test_speculative_config_is_checked() -> None:
    config = DraftConfig.from_speculative_config(
        {"method": "suffix", "num_speculative_tokens": 16, "suffix_decoding_min_token_prob": 0.2})
    assert config.method == "suffix" and config.num_speculative_tokens == 16
    assert config.min_token_prob == 0.2 and config.max_tree_depth == 64
    assert DraftConfig.from_speculative_config(
        {"method": "suffix", "suffix_decoding_draft_row_cost": 0.3}).draft_row_cost == 0.3
    assert DraftConfig.from_speculative_config(None).method is None
    for bad, what in (({"method": "eagle"}, "method"), ({"method": "suffix", "x": 1}, "x"),
                      ({"method": "suffix", "num_speculative_tokens": 0}, "num_speculative"),
                      ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "min_token")):
        with pytest.raises(InvalidRequestError, match=what):
            DraftConfig.from_speculative_config(bad)
    with pytest.raises(InvalidRequestError, match="give one"):
        SamplingParams(prompt_lookup=4, suffix_drafts=4)
    with pytest.raises(InvalidRequestError, match="suffix_drafts"):
        SamplingParams(suffix_drafts=65)


# -- the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_folder(tmp_path_factory.mktemp("suffix"), "gqa")


def engine(tiny: Path, **kwargs: object) -> LLM:
    return LLM(str(tiny), skip_tokenizer_init=True, kv_cache_memory=512 * 2048, block_size=4,
               **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def plain(tiny: Path) -> Iterator[LLM]:
    yield engine(tiny, enable_prefix_caching=False)


def greedy(max_tokens: int = 16, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          **kwargs)  # type: ignore[arg-type]


def outputs(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
            salt: str | None = None) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, cache_salt=salt)
    return [o.outputs[0].token_ids for o in outs]


def quoting_prompt(plain: LLM, seed: list[int]) -> list[int]:
    """A prompt that already holds the greedy continuation of its own ending."""
    truth = outputs(plain, [seed], [greedy(24)])[0]
    return seed + truth + [3] + seed


def test_suffix_drafts_give_the_greedy_output_alone_and_batched(tiny: Path, plain: LLM) -> None:
    llm = engine(tiny, speculative_config={"method": "suffix"})
    prompts = [quoting_prompt(plain, [9, 8, 7, 6]), quoting_prompt(plain, [20, 21]),
               [40, 41, 42], list(range(50, 80))]
    truths = outputs(plain, prompts, [greedy(24)] * 4)
    alone = [llm.generate({"prompt_token_ids": p}, greedy(24))[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in alone] == truths
    # The tiny model's greedy text falls into loops soon, which its own tree drafts.
    assert all(o.num_draft_tokens > 0 for o in alone)
    assert sum(o.num_accepted_tokens for o in alone) >= 16
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    mixed = [greedy(24), greedy(24, prompt_lookup=4), sampled, greedy(24, suffix_drafts=5)]
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], mixed)
    expected = truths[:2] + outputs(plain, [prompts[2]], [sampled]) + truths[3:]
    assert [o.outputs[0].token_ids for o in batched] == expected
    assert batched[2].num_draft_tokens == 0  # a sampled request drafts nothing
    llm.engine.check_integrity()
    assert llm.stats().num_blocks_used == 0 and not llm.engine.requests


def test_a_tenants_next_request_drafts_from_its_last_output(tiny: Path, plain: LLM) -> None:
    llm = engine(tiny, enable_prefix_caching=False)
    first = [30, 31, 32, 33]
    params = greedy(32, suffix_drafts=16)
    out = outputs(llm, [first], [params], salt="a")[0]
    assert out == outputs(plain, [first], [greedy(32)])[0]
    assert llm.stats().suffix_cached_outputs == 1
    second = first + out[:4]  # the next turn, which goes on as the last one did
    truth = outputs(plain, [second], [greedy(32)])[0]
    other = llm.generate({"prompt_token_ids": second}, params, cache_salt="b")[0]
    assert other.outputs[0].token_ids == truth and llm.stats().suffix_global_drafts == 0
    same = llm.generate({"prompt_token_ids": second}, params, cache_salt="a")[0]
    assert same.outputs[0].token_ids == truth
    assert llm.stats().suffix_global_drafts > 0
    assert same.num_accepted_tokens >= 16 > other.num_accepted_tokens
    assert llm.forget_drafts("a") == 2 and llm.forget_drafts("a") == 0


def test_the_store_bound_evicts_and_drafts_are_cut_to_max_tokens(tiny: Path,
                                                                 plain: LLM) -> None:
    llm = engine(tiny, speculative_config={"method": "suffix", "suffix_decoding_max_cached_tokens":
                                           20, "suffix_decoding_draft_row_cost": 0.2})
    prompt = quoting_prompt(plain, [9, 8, 7, 6])
    for max_tokens in (2, 3, 9, 17):
        out = llm.generate({"prompt_token_ids": prompt}, greedy(max_tokens))[0]
        assert out.outputs[0].token_ids == outputs(plain, [prompt], [greedy(max_tokens)])[0]
        assert out.num_draft_tokens <= max_tokens - 1
        assert llm.stats().suffix_cached_tokens <= 20
    drafts = llm.engine.hooks.features["drafts"]
    drafts.suffix.store.check()  # type: ignore[attr-defined]
    assert drafts.suffix.store.num_evicted > 0  # type: ignore[attr-defined]
