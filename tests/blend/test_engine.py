"""Blending on the engine, with a 4-layer tiny random model (fp32): the exact identities,
then the cases users hit (reordered, repeated, missed, short and mid-block chunks), scheduling
(batching, chunked prefill, preemption), no publication of approximate K/V, and pool integrity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvstack import LLM, BlendParams, Chunk, SamplingParams
from kvstack.blend.entry import ChunkEntry, chunk_key
from kvstack.kv.storage import KVCacheStorage
from kvstack.layers.attention import AttentionMetadata, PrefillSpan
from kvstack.outputs import BLENDED, COMPUTED

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
_g = torch.Generator().manual_seed(0)
DOCS = [tuple(torch.randint(3, 256, (n,), generator=_g).tolist()) for n in (37, 20, 45, 7)]
TEMPLATE = [1] + torch.randint(3, 256, (11,), generator=_g).tolist()
QUESTION = torch.randint(3, 256, (9,), generator=_g).tolist()
SELECTIONS = [BlendParams(recompute_ratio=r, selector=s, check_layer=c)
              for r, s, c in [(0.0, "kv_deviation", 1), (0.15, "kv_deviation", 1),
                              (0.3, "kv_deviation", 2), (0.15, "first_k", 1),
                              (0.15, "random", 1), (0.15, "attention", 1), (0.2, "impact", 0),
                              (0.15, "first_k_deviation", 1), (0.15, "gradual", 0)]]


def engine(folder: Path, **kwargs: Any) -> LLM:
    kwargs.setdefault("kv_cache_memory", "4MiB")
    kwargs.setdefault("block_size", 16)
    return LLM(str(folder), skip_tokenizer_init=True, **kwargs)


def segments(order: list[int], template: list[int] = TEMPLATE) -> dict[str, Any]:
    return {"segments": [template] + [Chunk(token_ids=DOCS[i]) for i in order] + [QUESTION]}


def flat(order: list[int], template: list[int] = TEMPLATE) -> dict[str, Any]:
    return {"prompt_token_ids": template + [t for i in order for t in DOCS[i]] + QUESTION}


def tokens(out: Any) -> list[int]:
    return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def llm(tiny4: Path) -> LLM:
    return engine(tiny4, enable_prefix_caching=False)


def warm(llm: LLM, docs: list[int]) -> None:
    llm.blender.cache.clear()  # type: ignore[union-attr]
    llm.precompute_chunks([Chunk(token_ids=DOCS[i]) for i in docs])


def test_ratio_one_is_full_prefill(llm: LLM) -> None:
    full = llm.score(flat([0, 1, 2]), num_positions=4)[0].logprobs
    for selector in ("kv_deviation", "first_k", "random", "attention", "impact",
                     "first_k_deviation", "gradual"):
        warm(llm, [0, 1, 2])
        out = llm.score(segments([0, 1, 2]), 4, BlendParams(recompute_ratio=1.0,
                                                           selector=selector))[0]
        assert (out.logprobs - full).abs().max() <= 1e-4
        assert out.output.blend is not None and out.output.blend.chunks_hit == 3
        assert out.output.blend.recomputed_tokens == out.output.blend.reused_tokens == 102
    llm.engine.check_integrity()


def exact_entries(llm: LLM, order: list[int]) -> None:
    """Put into the chunk cache each chunk's K/V as a full prefill of this very prompt
    computes them (an EXACT cache), keys turned back to before RoPE."""
    model, blender = llm.engine.model, llm.blender
    assert blender is not None
    ids = flat(order)["prompt_token_ids"]
    n = len(ids)
    storage = KVCacheStorage(model.config, -(-n // 16), 16, model.dtype)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), decode_rows=None,
                             decode_slots=None, decode_mask=None,
                             prefills=[PrefillSpan(0, n, n, None)])
    model.forward(torch.tensor(ids), torch.arange(n), meta, storage)
    blender.cache.clear()
    start = len(TEMPLATE)
    for i in order:
        end = start + len(DOCS[i])
        k = torch.stack([layer[start:end] for layer in storage.k])
        v = torch.stack([layer[start:end] for layer in storage.v])
        key = chunk_key(blender.fingerprint, None, blender.sink_ids, DOCS[i])
        blender.cache.put(ChunkEntry(key, blender.rotary.unrotate(k, torch.arange(start, end)),
                                     v.clone()))
        start = end


@pytest.mark.parametrize("params", SELECTIONS, ids=lambda p: f"{p.selector}-{p.recompute_ratio}")
def test_recompute_over_an_exact_cache_is_full_prefill(llm: LLM, params: BlendParams) -> None:
    full = llm.score(flat([2, 0, 1]), num_positions=4)[0].logprobs
    exact_entries(llm, [2, 0, 1])
    out = llm.score(segments([2, 0, 1]), 4, params)[0]
    assert out.output.blend is not None and out.output.blend.chunks_hit == 3
    assert out.output.blend.recomputed_tokens < 102 or params.recompute_ratio == 1
    assert (out.logprobs - full).abs().max() <= 1e-4
    llm.engine.check_integrity()


def test_placed_layer0_keys_and_values_equal_fresh_ones(llm: LLM) -> None:
    exact_entries(llm, [0, 1, 2])
    blender = llm.blender
    assert blender is not None
    fresh = {}
    for i in (0, 2):
        key = chunk_key(blender.fingerprint, None, blender.sink_ids, DOCS[i])
        fresh[i] = blender.cache.get(key)
    warm(llm, [0, 2])  # canonical entries now
    start = {0: len(TEMPLATE), 2: len(TEMPLATE) + len(DOCS[0]) + len(DOCS[1])}
    for i, exact in fresh.items():
        key = chunk_key(blender.fingerprint, None, blender.sink_ids, DOCS[i])
        canon = blender.cache.get(key)
        assert canon is not None and exact is not None
        pos = torch.arange(start[i], start[i] + len(DOCS[i]))
        placed_k = blender.rotary.rotate(canon.k[0], pos)
        assert (placed_k - blender.rotary.rotate(exact.k[0], pos)).abs().max() <= 1e-3
        assert (canon.v[0] - exact.v[0]).abs().max() <= 1e-3
        assert (canon.k[1:] - exact.k[1:]).abs().max() > 1e-3  # layer 1 on: context matters


def test_blending_is_approximate_and_deterministic(llm: LLM) -> None:
    warm(llm, [0, 1, 2])
    full = llm.score(flat([1, 2, 0]), num_positions=1)[0].logprobs
    first = llm.score(segments([1, 2, 0]), 1, BlendParams())[0]
    again = llm.score(segments([1, 2, 0]), 1, BlendParams())[0]
    assert torch.equal(first.logprobs, again.logprobs)
    assert (first.logprobs - full).abs().max() > 1e-3  # a test that can fail: it is not exact
    a = llm.generate(segments([1, 2, 0]), GREEDY, blend=BlendParams())[0]
    b = llm.generate(segments([1, 2, 0]), GREEDY, blend=BlendParams())[0]
    assert tokens(a) == tokens(b)
    usage = a.blend
    assert usage is not None and usage.reused_tokens == 102 and usage.recomputed_tokens == 15
    assert a.provenance.num_prompt(BLENDED) == 102 - 15
    assert a.provenance.num_prompt(COMPUTED) == len(flat([0])["prompt_token_ids"]) - 37 + 15
    llm.engine.check_integrity()


@pytest.mark.parametrize("order", [[0, 0, 1], [2, 1, 0], [0, 3, 2], [3, 3, 3]],
                         ids=["repeated", "new-order", "short", "short-thrice"])
def test_chunks_in_any_order_and_repeated(llm: LLM, order: list[int]) -> None:
    warm(llm, [0, 1, 2, 3])
    out = llm.generate(segments(order), GREEDY, blend=BlendParams())[0]
    assert out.blend is not None and out.blend.chunks_hit == 3 and out.blend.chunks_missed == 0
    assert out.blend.reused_tokens == sum(len(DOCS[i]) for i in order)
    ratio_one = llm.generate(segments(order), GREEDY, blend=BlendParams(recompute_ratio=1.0))
    assert tokens(ratio_one[0]) == tokens(llm.generate(flat(order), GREEDY)[0])
    llm.engine.check_integrity()


def test_missed_chunk_between_hits_is_computed_then_cached(llm: LLM) -> None:
    warm(llm, [0, 2])
    out = llm.generate(segments([0, 1, 2]), GREEDY, blend=BlendParams())[0]
    assert out.blend is not None
    assert (out.blend.chunks_hit, out.blend.chunks_missed) == (2, 1)
    assert out.blend.reused_tokens == 82
    one = llm.generate(segments([0, 1, 2]), GREEDY, blend=BlendParams(recompute_ratio=1.0))[0]
    assert one.blend is not None and one.blend.chunks_hit == 3  # the miss was cached after
    assert tokens(one) == tokens(llm.generate(flat([0, 1, 2]), GREEDY)[0])
    llm.engine.check_integrity()


def test_first_k_deviation_keeps_each_chunks_first_tokens(llm: LLM) -> None:
    warm(llm, [0, 1, 2])
    out = llm.generate(segments([0, 1, 2]), GREEDY, blend=BlendParams(
        selector="first_k_deviation", recompute_ratio=0.2))[0]
    assert out.blend is not None and out.blend.recomputed_tokens == 20  # 0.2 x 102, rounded
    runs, at, blended = out.provenance.prompt, 0, set()
    for source, count in runs:
        if source == BLENDED:
            blended |= set(range(at, at + count))
        at += count
    start = len(TEMPLATE)
    for i in (0, 1, 2):
        assert not blended & set(range(start, start + 4))  # each chunk's first 4 recomputed
        start += len(DOCS[i])


def test_gradual_keeps_twice_the_ratio_then_the_ratio(llm: LLM) -> None:
    """`gradual` drops placed tokens twice: at the check layer down to GRADUAL_WIDEN x the
    ratio, GRADUAL_GAP layers later down to the ratio; the compute it reports counts both."""
    from kvstack.blend.selectors import GRADUAL_GAP, GRADUAL_WIDEN

    assert GRADUAL_GAP < 4  # the tiny model's 4 layers hold both stages from check layer 0
    warm(llm, [0, 1, 2])
    outs = {s: llm.generate(segments([0, 1, 2]), GREEDY, blend=BlendParams(
        selector=s, recompute_ratio=0.1, check_layer=0))[0] for s in ("kv_deviation", "gradual")}
    one, two = outs["kv_deviation"].blend, outs["gradual"].blend
    assert one is not None and two is not None
    assert one.recomputed_tokens == two.recomputed_tokens == 10  # 0.1 x 102
    n = len(flat([0, 1, 2])["prompt_token_ids"])
    wide = round(GRADUAL_WIDEN * 10)
    # prompt token-layers: the template's rows at every layer; from the check layer on, the
    # region's rows still computed (the kept placed tokens and the question)
    exact, rest = 4 * len(TEMPLATE), n - len(TEMPLATE) - 102
    expected_one = exact + 4 * (rest + 10)
    expected_two = exact + GRADUAL_GAP * (rest + wide) + (4 - GRADUAL_GAP) * (rest + 10)
    assert one.compute == pytest.approx(expected_one / (4 * n))
    assert two.compute == pytest.approx(expected_two / (4 * n))
    llm.engine.check_integrity()
