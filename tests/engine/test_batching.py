"""Continuous batching, chunked prefill, preemption and prefix caching on the embedded model.

Every greedy output is compared token for token with the same prompt run alone (one request
per generate call, prefix caching off): batch composition, arrival order, chunk size, block
size, prefix caching and preemption must never change what a request generates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from kvstack import LLM, SamplingParams
from kvstack.errors import CapacityError
from kvstack.outputs import RequestOutput

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# K and V x 30 layers x 3 KV heads x 64 dims x 4 bytes (float32), per token.
BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4

SHARED = (
    "You are a careful assistant. Answer in one short paragraph, use plain words, and "
    "never invent facts you are unsure about. The user is a student preparing for an exam "
    "on European history and geography."
)  # 40 tokens: 5 blocks of 8, 2 of 16, 1 of 32
PROMPTS = [
    SHARED + " Question: what is the capital of France?",  # 49 tokens
    "Hello",  # 1 token
    SHARED + " Question: which river flows through Vienna?",  # 48 tokens: 3 full blocks of 16
    "def fibonacci(n):\n    ",  # 7 tokens
    ", ".join(str(i) for i in range(1, 31)) + ",",  # 110 tokens: 7 blocks of 16
    SHARED + " Question: name three countries that border Germany.",  # 49 tokens
]


def make_llm(**kwargs: Any) -> LLM:
    kwargs.setdefault("kv_cache_memory", "64MiB")
    return LLM("smollm2-135m", **kwargs)


def token_ids(outputs: Sequence[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_idle(llm: LLM) -> None:
    """Integrity holds and, with every request ended, no block is in use."""
    llm.engine.check_integrity()
    s = llm.stats()
    assert (s.num_requests_running, s.num_requests_waiting) == (0, 0)
    assert s.num_blocks_used == 0 and s.num_blocks_free == s.num_blocks_total
    assert not llm.engine.requests


def check_step_accounting(llm: LLM) -> None:
    """Between steps: integrity, and the pool's in-use count is exactly the blocks the running
    requests hold (shared prefix blocks counted once); waiting requests hold none."""
    llm.engine.check_integrity()
    s = llm.stats()
    sched, kv = llm.engine.scheduler, llm.engine.kv_manager
    held = {i for r in sched.running for i in kv.block_ids(r.request_id)}
    assert s.num_blocks_used == len(held)
    assert s.num_blocks_free + s.num_blocks_used == s.num_blocks_total
    assert all(not kv.block_ids(r.request_id) for r in sched.waiting)
    assert (s.num_requests_running, s.num_requests_waiting) == (len(sched.running),
                                                                 len(sched.waiting))


def drive(
    llm: LLM,
    arrivals: dict[int, list[tuple[str, Any]]],
    params: SamplingParams = GREEDY,
) -> dict[str, RequestOutput]:
    """Step the engine to completion, adding `arrivals[step]` (request id, prompt) before
    that step, and checking block accounting after every step."""
    engine = llm.engine
    final: dict[str, RequestOutput] = {}
    step = 0
    while engine.has_unfinished() or any(k >= step for k in arrivals):
        for request_id, prompt in arrivals.get(step, []):
            engine.add_request(prompt, params, request_id=request_id)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        check_step_accounting(llm)
        step += 1
        assert step < 2000, "engine did not finish"
    return final


@pytest.fixture(scope="module")
def reference() -> tuple[LLM, list[list[int]]]:
    """Each prompt alone, no prefix caching: the outputs every other run must reproduce."""
    llm = make_llm(enable_prefix_caching=False)
    outputs = [llm.generate(p, GREEDY)[0] for p in PROMPTS]
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)
    assert all(o.num_cached_tokens == 0 for o in outputs)
    assert_idle(llm)
    return llm, token_ids(outputs)


@pytest.fixture(scope="module")
def expected(reference: tuple[LLM, list[list[int]]]) -> list[list[int]]:
    return reference[1]


@pytest.fixture(scope="module")
def llm_tokenizer(reference: tuple[LLM, list[list[int]]]) -> Any:
    return reference[0].get_tokenizer()


def test_prompt_lengths_cover_the_block_boundaries_we_rely_on(llm_tokenizer: Any) -> None:
    lengths = [len(llm_tokenizer.encode(p)) for p in PROMPTS]
    assert lengths == [49, 1, 48, 7, 110, 49]
    assert len(llm_tokenizer.encode(SHARED)) == 40


# --- batch composition, order, chunking, block size, prefix caching ----------------------


def test_one_batch_matches_one_at_a_time(expected: list[list[int]]) -> None:
    llm = make_llm()
    outputs = llm.generate(PROMPTS, GREEDY)
    assert token_ids(outputs) == expected
    assert [o.request_id for o in outputs] == [str(i) for i in range(len(PROMPTS))]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert_idle(llm)


def test_subsets_in_shuffled_order_match_and_hit_the_prefix_cache(
    expected: list[list[int]],
) -> None:
    llm = make_llm()
    got: dict[int, RequestOutput] = {}
    for subset in ([2], [5, 0, 4], [3, 1]):
        outputs = llm.generate([PROMPTS[i] for i in subset], GREEDY)
        got.update(zip(subset, outputs, strict=True))
        assert_idle(llm)
    assert [got[i].outputs[0].token_ids for i in range(len(PROMPTS))] == expected
    # Prompts 5 and 0 came after 2 had computed the 40-token shared prefix: 2 blocks of 16.
    assert [got[i].num_cached_tokens for i in range(len(PROMPTS))] == [32, 0, 0, 0, 0, 32]
    assert llm.stats().prefix_cache_hit_tokens == 64


@pytest.mark.parametrize(
    ("max_num_batched_tokens", "block_size", "enable_prefix_caching"),
    [(16, 8, True), (33, 16, True), (64, 32, True), (33, 8, False), (16, 32, False)],
)
def test_chunked_prefill_block_size_and_prefix_caching_do_not_change_outputs(
    expected: list[list[int]],
    max_num_batched_tokens: int,
    block_size: int,
    enable_prefix_caching: bool,
) -> None:
    llm = make_llm(
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
    )
    outputs = llm.generate(PROMPTS, GREEDY)
    assert token_ids(outputs) == expected
    s = llm.stats()
    assert s.block_size == block_size and s.num_preemptions == 0
    if enable_prefix_caching:
        # A small budget admits requests over several steps, so later ones find the shared
        # prefix already computed by earlier ones in the same batch.
        assert s.prefix_cache_hit_tokens > 0
        assert s.num_blocks_cached > 0
    else:
        assert s.prefix_cache_hit_tokens == 0 and s.num_blocks_cached == 0
    assert_idle(llm)


def test_staggered_arrivals_match(expected: list[list[int]]) -> None:
    # Reverse order, one arrival every 3 steps, on a small budget: prefills of new arrivals
    # are chunked between the decodes of those already running.
    llm = make_llm(max_num_batched_tokens=33)
    arrivals = {3 * k: [(f"p{i}", PROMPTS[i])] for k, i in enumerate(reversed(range(6)))}
    final = drive(llm, arrivals)
    assert [final[f"p{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == expected
    # p2 arrives after p5 has computed the shared prefix.
    assert final["p2"].num_cached_tokens == 32
    assert_idle(llm)


@pytest.mark.parametrize(
    ("enable_prefix_caching", "max_num_batched_tokens"), [(True, 2048), (False, 33)]
)
def test_preemption_under_a_tiny_kv_budget_keeps_outputs(
    expected: list[list[int]], enable_prefix_caching: bool, max_num_batched_tokens: int
) -> None:
    block_size = 16
    biggest = max(len(ids) for ids in expected)  # every output is MAX_TOKENS long
    need = -(-(110 + biggest) // block_size)  # the 110-token prompt: 9 blocks
    num_blocks = need + 2
    llm = make_llm(
        kv_cache_memory=num_blocks * block_size * BYTES_PER_TOKEN,
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    assert llm.stats().num_blocks_total == num_blocks == 11
    arrivals = {0: [(f"p{i}", p) for i, p in enumerate(PROMPTS)]}
    final = drive(llm, arrivals)
    assert [final[f"p{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == expected
    assert llm.stats().num_preemptions > 0
    assert_idle(llm)


def test_seeded_sampling_is_batch_invariant_under_preemption(
    reference: tuple[LLM, list[list[int]]],
) -> None:
    # Each seeded request draws from its own generator, once per sampled token: recomputing
    # a preempted request must not draw again, and neighbours in the batch must not matter.
    picks = [4, 0, 3]
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=12, ignore_eos=True)
        for i in picks
    ]
    alone = [reference[0].generate(PROMPTS[i], p)[0] for i, p in zip(picks, params, strict=True)]
    # 11 blocks: the 110-token prompt (7 blocks) and the 49-token one (4) fill the pool, so
    # the first's 8th block preempts the second.
    llm = make_llm(kv_cache_memory=11 * 16 * BYTES_PER_TOKEN)
    batched = llm.generate([PROMPTS[i] for i in picks], params)
    assert token_ids(batched) == token_ids(alone)
    assert llm.stats().num_preemptions > 0
    assert_idle(llm)


# --- prefix cache -------------------------------------------------------------------------


def test_cache_salt_isolates_prefixes(expected: list[list[int]]) -> None:
    llm = make_llm()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    runs = [
        llm.generate(PROMPTS[0], params, cache_salt=salt)[0]
        for salt in ("alice", "bob", None, "alice")
    ]
    # 49 prompt tokens: at most 3 full blocks (48 tokens) can come from the cache.
    assert [r.num_cached_tokens for r in runs] == [0, 0, 0, 48]
    assert all(r.outputs[0].token_ids == expected[0][:4] for r in runs)
    assert_idle(llm)


def test_fully_cached_prompt_still_computes_its_last_token(
    reference: tuple[LLM, list[list[int]]], llm_tokenizer: Any
) -> None:
    prompt = {"prompt_token_ids": llm_tokenizer.encode(PROMPTS[4])[:32]}  # exactly 2 blocks
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = reference[0].generate(prompt, params)[0]
    llm = make_llm()
    first, again = llm.generate(prompt, params)[0], llm.generate(prompt, params)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 16)  # not 32
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == alone.outputs[0].token_ids
    assert llm.stats().prefix_cache_hit_tokens == 16
    assert_idle(llm)


def test_reset_prefix_cache_drops_cached_blocks(expected: list[list[int]]) -> None:
    llm = make_llm()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate(PROMPTS[0], params)[0]
    cached = llm.stats().num_blocks_cached
    assert cached == 3  # 49 + 3 computed tokens: 3 full blocks
    assert llm.reset_prefix_cache() == cached
    assert llm.stats().num_blocks_cached == 0 and llm.stats().num_blocks_free == 91
    again = llm.generate(PROMPTS[0], params)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 0)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected[0][:4]
    assert llm.reset_prefix_cache() == 3
    assert_idle(llm)


# --- admission, abort, stats --------------------------------------------------------------


def test_too_big_request_is_refused_while_others_keep_running(
    expected: list[list[int]],
) -> None:
    llm = make_llm(kv_cache_memory=12 * 16 * BYTES_PER_TOKEN)  # 12 blocks, 192 tokens
    engine = llm.engine
    engine.add_request(PROMPTS[0], GREEDY, request_id="a")
    engine.add_request(PROMPTS[3], GREEDY, request_id="b")
    engine.step()
    engine.step()
    used = llm.stats().num_blocks_used
    too_big = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)  # 110 + 100
    with pytest.raises(CapacityError, match=r"needs 14 KV blocks .* pool holds 12"):
        engine.add_request(PROMPTS[4], too_big, request_id="big")
    assert "big" not in engine.requests and llm.stats().num_requests_waiting == 0
    assert llm.stats().num_blocks_used == used
    final = drive(llm, {})
    assert final["a"].outputs[0].token_ids == expected[0]
    assert final["b"].outputs[0].token_ids == expected[3]
    assert_idle(llm)
    # Through generate: the batch is refused as a whole and nothing stays queued.
    with pytest.raises(CapacityError):
        llm.generate([PROMPTS[0], PROMPTS[4]], [GREEDY, too_big])
    assert_idle(llm)


def test_engine_abort_frees_blocks_at_once(expected: list[list[int]]) -> None:
    llm = make_llm()
    engine, kv = llm.engine, llm.engine.kv_manager
    long = engine.add_request(PROMPTS[4], GREEDY, request_id="long")
    keep = engine.add_request(PROMPTS[0], GREEDY, request_id="keep")
    for _ in range(3):
        engine.step()
    check_step_accounting(llm)
    assert len(kv.block_ids(long.request_id)) == 7  # 110 prompt + 2 output tokens computed
    used = llm.stats().num_blocks_used
    assert used == len(kv.block_ids("long")) + len(kv.block_ids(keep.request_id)) == 7 + 4
    engine.abort("long")
    assert llm.stats().num_blocks_used == used - 7 and kv.block_ids(long.request_id) == []
    assert long.finish_reason == "abort"
    check_step_accounting(llm)
    waiting = engine.add_request(PROMPTS[3], GREEDY, request_id="never-run")
    engine.abort("never-run")  # aborted before it was scheduled
    engine.abort("no-such-id")  # unknown ids are ignored
    assert waiting.finish_reason == "abort" and llm.stats().num_requests_waiting == 0
    final = drive(llm, {})
    assert set(final) == {"keep"}
    assert final["keep"].outputs[0].token_ids == expected[0]
    engine.abort("keep")  # already finished: ignored
    assert_idle(llm)


def test_stats_follow_a_scripted_scenario(expected: list[list[int]]) -> None:
    llm = make_llm()  # 64 MiB / (16 tokens x 46080 B) = 91 blocks
    s = llm.stats()
    assert (s.num_blocks_total, s.num_blocks_free, s.num_blocks_cached, s.num_blocks_used) == (
        91, 91, 0, 0
    )
    assert (s.block_size, s.kv_cache_bytes) == (16, 91 * 16 * BYTES_PER_TOKEN)
    assert (s.prefix_cache_query_tokens, s.prefix_cache_hit_tokens, s.num_preemptions) == (0, 0, 0)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = llm.engine
    engine.add_request(PROMPTS[0], params, request_id="a")  # 49 tokens
    engine.add_request(PROMPTS[2], params, request_id="b")  # 48 tokens
    s = llm.stats()
    assert (s.num_requests_running, s.num_requests_waiting, s.num_blocks_used) == (0, 2, 0)
    engine.step()  # a prefills; b waits, since its first block is a's, still being computed
    s = llm.stats()
    assert (s.num_requests_running, s.num_requests_waiting) == (1, 1)
    assert (s.num_blocks_used, s.num_blocks_free, s.num_blocks_cached) == (4, 87, 0)
    assert s.kv_cache_usage == pytest.approx(4 / 91)
    assert (s.prefix_cache_query_tokens, s.prefix_cache_hit_tokens) == (49, 0)
    engine.step()  # a decodes; b is admitted with a's two shared-prefix blocks as a hit
    s = llm.stats()
    assert (s.num_requests_running, s.num_requests_waiting) == (2, 0)
    assert (s.prefix_cache_query_tokens, s.prefix_cache_hit_tokens) == (97, 32)
    # a: 50 tokens in 4 blocks; b: 48 in 3, the first 2 of them a's.
    assert (s.num_blocks_used, s.num_blocks_free, s.num_blocks_cached) == (4 + 1, 86, 0)
    final = drive(llm, {}, params)
    assert final["a"].outputs[0].token_ids == expected[0][:4]
    assert final["b"].outputs[0].token_ids == expected[2][:4]
    assert final["b"].num_cached_tokens == 32
    s = llm.stats()
    # a: 52 tokens computed -> 3 full blocks; b: 51 -> 3, of which the first 2 are a's.
    assert (s.num_blocks_used, s.num_blocks_free, s.num_blocks_cached) == (0, 91, 4)
    c = llm.generate(PROMPTS[5], params)[0]
    assert c.num_cached_tokens == 32 and c.outputs[0].token_ids == expected[5][:4]
    s = llm.stats()
    assert (s.prefix_cache_query_tokens, s.prefix_cache_hit_tokens) == (97 + 49, 64)
    assert s.prefix_cache_hit_rate == pytest.approx(64 / 146)
    assert (s.num_prompt_tokens, s.num_generation_tokens, s.num_preemptions) == (146, 12, 0)
    # c: 52 computed -> 3 full blocks; 2 are a's (hit), 1 is new.
    assert s.num_blocks_cached == 5
    assert_idle(llm)
