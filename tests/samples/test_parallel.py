"""Parallel samples (n, best_of) on the embedded model: the prompt computed once and its
blocks shared, copy-on-write of the shared tail only, sample i equal to a lone request with
seed + i in the same batch (float and quantized KV), and one sample preempted or aborted,
prefix hits and the disk tier, best_of, top logprobs and the refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvstack import LLM, SamplingParams
from kvstack.errors import CapacityError, InvalidRequestError
from kvstack.outputs import RequestOutput

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PROMPT = ("Write a short poem about the sea, the wind and the old lighthouse keeper who "
          "watches the ships come home.")  # 25 tokens: a full block and 9 more (16-token blocks)


def make_llm(**kwargs: Any) -> LLM:
    kwargs.setdefault("kv_cache_memory", "48MiB")
    return LLM("smollm2-135m", **kwargs)


def sampled(n: int = 1, seed: int | None = 7, max_tokens: int = 12, **kw: Any) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.9, top_p=0.95, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True, **kw)


def finish(llm: LLM) -> None:
    llm.engine.check_integrity()
    stats = llm.stats()
    assert stats.num_blocks_used == 0 and not llm.engine.requests
    assert (stats.num_requests_running, stats.num_requests_waiting) == (0, 0)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int4"])
def test_seeded_n4_equals_four_seeded_requests_in_the_same_batch(kv_cache_dtype: str) -> None:
    llm = make_llm(kv_cache_dtype=kv_cache_dtype)
    group, *alone = llm.generate([PROMPT] * 5, [sampled(n=4)] + [sampled(seed=7 + i)
                                                                 for i in range(4)])
    assert [c.index for c in group.outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in group.outputs] == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in group.outputs}) == 4, "samples must differ"
    assert llm.stats().num_copied_blocks == 3  # the 9-token tail, once per sample but the last
    finish(llm)


def test_the_prompt_is_computed_once_and_its_blocks_held_once() -> None:
    llm = make_llm(enable_prefix_caching=False)
    engine = llm.engine
    num_prompt = len(llm.get_tokenizer().encode(PROMPT))
    engine.add_request(PROMPT, sampled(n=4), request_id="g")
    engine.step()  # the prefill, and the forks
    ids = [engine.kv_manager.block_ids(f"g#{i}") for i in range(4)]
    assert ids == [ids[0]] * 4 and len(ids[0]) == 2
    assert llm.stats().num_blocks_used == 2 and llm.stats().num_prompt_tokens == num_prompt
    engine.step()  # each sample writes its first token: the partly filled tail is copied
    tables = [engine.kv_manager.block_ids(f"g#{i}") for i in range(4)]
    assert {t[0] for t in tables} == {ids[0][0]}, "the full prompt block stays shared"
    assert len({t[1] for t in tables}) == 4 and llm.stats().num_copied_blocks == 3
    assert llm.stats().num_blocks_used == 1 + 4
    engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
    finish(llm)


def test_aborting_one_sample_mid_stream_leaves_the_others_and_leaks_nothing() -> None:
    llm = make_llm()
    engine = llm.engine
    engine.add_request(PROMPT, sampled(n=3, max_tokens=16), request_id="g")
    outs: list[RequestOutput] = []
    for step in range(40):
        if step == 4:
            engine.abort("g#1")
            engine.check_integrity()
        outs += engine.step()
        if outs and outs[-1].finished:
            break
    final = outs[-1]
    assert final.finished and final.request_id == "g"
    reasons = [c.finish_reason for c in final.outputs]
    assert reasons == ["length", "abort", "length"]
    assert 0 < len(final.outputs[1].token_ids) < 16
    alone = llm.generate(PROMPT, sampled(seed=9, max_tokens=16))[0]
    assert final.outputs[2].token_ids == alone.outputs[0].token_ids
    finish(llm)


def test_aborting_the_last_running_sample_reports_the_request() -> None:
    llm = make_llm()
    engine = llm.engine
    engine.add_request(PROMPT, sampled(n=2, max_tokens=30), request_id="g")
    engine.step()
    engine.abort("g#0")
    engine.abort("g#1")
    outs = engine.step()
    assert [o.request_id for o in outs] == ["g"] and outs[0].finished
    assert [c.finish_reason for c in outs[0].outputs] == ["abort", "abort"]
    finish(llm)


def test_preempted_samples_recompute_and_give_the_same_tokens() -> None:
    roomy = make_llm()
    want = roomy.generate([PROMPT] * 2, [sampled(n=4, max_tokens=40), sampled(n=3, seed=1,
                                                                              max_tokens=40)])
    tight = make_llm(kv_cache_memory=14 * 16 * 2 * 30 * 3 * 64 * 4)  # 14 blocks for ~21
    got = tight.generate([PROMPT] * 2, [sampled(n=4, max_tokens=40), sampled(n=3, seed=1,
                                                                             max_tokens=40)])
    assert tight.stats().num_preemptions > 0
    for a, b in zip(want, got, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    finish(tight)


def test_a_cached_prompt_and_the_disk_tier_feed_the_samples(tmp_path: Path) -> None:
    prompt = PROMPT + " " + PROMPT
    first = make_llm(kv_disk_dir=tmp_path)
    first.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
    want = first.generate(prompt, sampled(n=3))[0]
    cached = (len(want.prompt_token_ids) - 1) // 16 * 16  # every full block but the last token's
    assert cached >= 32 and want.num_cached_tokens == cached
    first.close()
    second = make_llm(kv_disk_dir=tmp_path)  # a fresh process's memory: restored from disk
    got = second.generate(prompt, sampled(n=3))[0]
    assert got.num_cached_tokens == cached and second.stats().tier_hit_tokens == cached
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    finish(second)
    second.close()


def test_best_of_returns_the_n_most_likely_samples() -> None:
    llm = make_llm()
    out = llm.generate(PROMPT, sampled(n=2, best_of=4))[0]
    everything = llm.generate(PROMPT, sampled(n=4, logprobs=0))[0]
    ranked = sorted(everything.outputs, key=lambda c: -(c.cumulative_logprob or 0))[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked]
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in out.outputs)
    finish(llm)


def test_top_logprobs_are_the_most_likely_tokens_of_the_raw_distribution() -> None:
    llm = make_llm()
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=5))[0]
    c = out.outputs[0]
    assert c.top_logprobs is not None and len(c.top_logprobs) == 6
    for token, logprob, top in zip(c.token_ids, c.logprobs or [], c.top_logprobs, strict=True):
        assert len(top) == 5 and top[0][0] == token  # greedy: the chosen one is the top one
        assert abs(top[0][1] - logprob) < 1e-5
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert sum(torch.tensor([v for _, v in top]).exp()) <= 1 + 1e-5
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=0))[0]
    assert plain.outputs[0].top_logprobs is None
    assert plain.outputs[0].token_ids == c.token_ids
    finish(llm)


def test_window_mode_runs_parallel_samples() -> None:
    llm = make_llm(kv_window=64, enable_prefix_caching=False)
    out = llm.generate(PROMPT, sampled(n=3, max_tokens=60))[0]
    assert [len(c.token_ids) for c in out.outputs] == [60, 60, 60]
    finish(llm)


def test_refusals_leave_nothing_behind() -> None:
    llm = make_llm(kv_cache_memory=8 * 16 * 2 * 30 * 3 * 64 * 4, max_parallel_samples=4)
    with pytest.raises(InvalidRequestError, match="at most 4 parallel samples"):
        llm.generate(PROMPT, sampled(n=5))
    with pytest.raises(InvalidRequestError, match="best_of is 6"):
        llm.generate(PROMPT, sampled(n=2, best_of=6))
    # Alone it fits (3 blocks); four samples of 80 tokens do not (1 shared + 4 x 6 blocks).
    llm.generate(PROMPT, sampled(max_tokens=20))
    with pytest.raises(CapacityError, match="x 4 samples"):
        llm.generate(PROMPT, sampled(n=4, max_tokens=80))
    finish(llm)


def test_streaming_a_group_yields_every_sample_each_step() -> None:
    llm = make_llm()
    seen = list(llm.stream(PROMPT, sampled(n=2, max_tokens=5)))
    assert all(len(o.outputs) == 2 and o.request_id == seen[0].request_id for o in seen)
    assert seen[-1].finished and [len(c.token_ids) for c in seen[-1].outputs] == [5, 5]
    finish(llm)
