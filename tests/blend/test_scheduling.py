"""Blended requests with the prefix cache, other requests, chunked prefill and preemption on
a 4-layer tiny random model: the exact prefix comes first, nothing approximate is published,
and scheduling never changes a blended request's output. Plus the typed errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_engine import DOCS, GREEDY, QUESTION, TEMPLATE, engine, flat, segments, tokens

from kvstack import BlendParams, Chunk, SamplingParams
from kvstack.blend.params import BlendError
from kvstack.errors import KvstackError
from kvstack.outputs import BLENDED, PREFIX_CACHE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG_TEMPLATE = TEMPLATE + list(range(100, 124))  # 36 tokens: 2 full blocks of 16 and 4


def test_exact_prefix_first_then_a_chunk_starting_mid_block(tiny4: Path) -> None:
    llm = engine(tiny4)
    llm.precompute_chunks([Chunk(token_ids=d) for d in DOCS])
    # An exact run publishes the template's full blocks (and its chunks', exactly computed).
    llm.generate(flat([1, 0], LONG_TEMPLATE), GREEDY)
    out = llm.generate(segments([0, 2, 1], LONG_TEMPLATE), GREEDY, blend=BlendParams())[0]
    assert out.num_cached_tokens == 32  # the template's 2 full blocks; doc 0 differs after
    assert out.provenance.prompt[0] == (PREFIX_CACHE, 32)
    assert out.blend is not None and out.blend.chunks_hit == 3
    # Nothing past the exact part was published: the same prompt again hits 32 tokens only.
    again = llm.generate(segments([0, 2, 1], LONG_TEMPLATE), GREEDY, blend=BlendParams())[0]
    assert again.num_cached_tokens == 32 and tokens(again) == tokens(out)
    exact = llm.generate(flat([0, 2, 1], LONG_TEMPLATE), GREEDY)[0]
    assert exact.num_cached_tokens == 32
    llm.engine.check_integrity()


def test_a_chunk_straddling_the_prefix_hit_is_placed_after_it(tiny4: Path) -> None:
    llm = engine(tiny4)
    llm.precompute_chunks([Chunk(token_ids=d) for d in DOCS])
    llm.generate(flat([0, 1], LONG_TEMPLATE), GREEDY)  # publishes template + doc 0's blocks
    out = llm.generate(segments([0, 2], LONG_TEMPLATE), GREEDY, blend=BlendParams(
        recompute_ratio=1.0))[0]
    hit = out.num_cached_tokens
    assert len(LONG_TEMPLATE) < hit < len(LONG_TEMPLATE) + len(DOCS[0])
    assert out.blend is not None and out.blend.chunks_hit == 2
    assert out.blend.reused_tokens == len(LONG_TEMPLATE) + len(DOCS[0]) - hit + len(DOCS[2])
    assert tokens(out) == tokens(llm.generate(flat([0, 2], LONG_TEMPLATE), GREEDY)[0])
    llm.engine.check_integrity()


def test_batching_and_chunked_prefill_do_not_change_the_output(tiny4: Path) -> None:
    alone = engine(tiny4)
    alone.precompute_chunks([Chunk(token_ids=d) for d in DOCS])
    solo = tokens(alone.generate(segments([2, 0, 1], LONG_TEMPLATE), GREEDY,
                                 blend=BlendParams())[0])
    # A 140-token step budget: the other prompt takes most of the first step, so the blended
    # request's template is prefilled in pieces before its region.
    busy = engine(tiny4, max_num_batched_tokens=140)
    busy.precompute_chunks([Chunk(token_ids=d) for d in DOCS])
    other = {"segments": [list(range(3, 130))]}
    outs = busy.generate([other, segments([2, 0, 1], LONG_TEMPLATE),
                          segments([1, 2], LONG_TEMPLATE)], GREEDY, blend=BlendParams())
    assert tokens(outs[1]) == solo
    assert outs[0].blend is None and outs[2].blend is not None
    busy.engine.check_integrity()


def test_a_region_longer_than_the_step_budget_runs_whole_in_one_step(tiny4: Path) -> None:
    roomy = engine(tiny4)
    roomy.precompute_chunks([Chunk(token_ids=d) for d in DOCS])
    prompts = [segments([2, 0, 1], LONG_TEMPLATE), {"segments": [list(range(3, 60))]}]
    expected = roomy.generate(prompts, GREEDY, blend=BlendParams())
    # A 24-token budget: the 36-token template takes two steps, then the 111-token region
    # (45 + 37 + 20 chunk tokens and the question) one step past the budget, beside the
    # other prompt's pieces.
    tight = engine(tiny4, max_num_batched_tokens=24)
    tight.precompute_chunks([Chunk(token_ids=d) for d in DOCS])
    outs = tight.generate(prompts, GREEDY, blend=BlendParams())
    assert [tokens(o) for o in outs] == [tokens(o) for o in expected]
    assert outs[0].blend == expected[0].blend and outs[0].blend is not None
    assert outs[0].blend.chunks_hit == 3
    tight.engine.check_integrity()


def test_preemption_does_not_change_the_output(tiny4: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    roomy = engine(tiny4)
    roomy.precompute_chunks([Chunk(token_ids=d) for d in DOCS])
    prompts = [segments(o) for o in ([0, 1, 2], [2, 1, 0], [1, 0, 2])]
    expected = [tokens(o) for o in roomy.generate(prompts, params, blend=BlendParams())]
    # 20 blocks of 16: three requests of ~180 tokens each cannot all stay.
    tight = engine(tiny4, kv_cache_memory=20 * 16 * 4096)
    tight.precompute_chunks([Chunk(token_ids=d) for d in DOCS])
    outs = tight.generate(prompts, params, blend=BlendParams())
    assert tight.engine.stats().num_preemptions > 0
    assert [tokens(o) for o in outs] == expected
    assert all(o.provenance.num_prompt(BLENDED) > 0 for o in outs)
    tight.engine.check_integrity()


def test_bad_inputs_are_typed_errors(tiny4: Path) -> None:
    llm = engine(tiny4, max_num_batched_tokens=256)
    cases = [
        ({"segments": [Chunk(token_ids=tuple(range(3, 200)) * 3)]}, "context"),
        ({"segments": [[1, 2], Chunk(token_ids=())]}, "empty chunk"),
        ({"segments": [[], []]}, "no text"),
    ]
    for prompt, match in cases:
        with pytest.raises(KvstackError, match=match):
            llm.generate(prompt, GREEDY, blend=BlendParams())
    with pytest.raises(BlendError, match="check_layer"):
        llm.generate(segments([0]), GREEDY, blend=BlendParams(check_layer=4))
    with pytest.raises(BlendError, match="prompt_logprobs"):
        llm.generate(segments([0]), SamplingParams(max_tokens=2, prompt_logprobs=1),
                     blend=BlendParams())
    window = engine(tiny4, kv_window=64)
    with pytest.raises(BlendError, match="window"):
        window.generate(segments([0]), GREEDY, blend=BlendParams())
    with pytest.raises(KvstackError):
        llm.precompute_chunks([Chunk(token_ids=())])
    with pytest.raises(BlendError, match="longer than"):
        llm.precompute_chunks([Chunk(token_ids=(7,) * 512)])
    llm.engine.check_integrity()
    # Without blend=, a segmented prompt is an ordinary exact prompt.
    plain = llm.generate(segments([0, 1]), GREEDY)[0]
    assert plain.blend is None and tokens(plain) == tokens(llm.generate(flat([0, 1]), GREEDY)[0])
    assert QUESTION
