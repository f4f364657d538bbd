"""Greedy generation end to end: with the KV cache, without it, and transformers' `generate`
agree token for token; K/V once in the cache never change."""

from __future__ import annotations

import pydoc_data.topics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.tiny_models import VARIANTS, make_tiny_hf_folder
from transformers import AutoModelForCausalLM, DynamicCache

from kvstack import LLM, SamplingParams
from kvstack.engine.core import LLMEngine
from kvstack.engine.request import Request

NUM_NEW_TOKENS = 64
# Max |ours - transformers| on cached K/V (fp32, same weights); measured 1.5e-5 on values up
# to ~14 in the last layer.
KV_ATOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def greedy(num_new: int) -> SamplingParams:
    # ignore_eos: both sides run the full length; nothing touches the logits.
    return SamplingParams(temperature=0, max_tokens=num_new, ignore_eos=True)


def our_greedy(llm: LLM, prompts: Sequence[Sequence[int]], num_new: int) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], greedy(num_new))
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


def hf_greedy(hf: Any, prompts: Sequence[Sequence[int]], num_new: int) -> list[list[int]]:
    """transformers' greedy continuation, one prompt per call (no padding). The caller has set
    `hf.generation_config.eos_token_id = None`: passing eos=None to `generate` would be
    overridden by the model's generation config, and min_new_tokens would mask EOS logits."""
    assert hf.generation_config.eos_token_id is None
    out = []
    for p in prompts:
        ids = hf.generate(torch.tensor([list(p)]), max_new_tokens=num_new, do_sample=False,
                          pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


# -- the embedded model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    """A short text prompt, one of ~4 blocks, and a chat-template prompt."""
    tok = llm.get_tokenizer()
    chat = llm.apply_chat_template([{"role": "user", "content": "Name three uses of a cache."}])
    return [
        tok.encode("The capital of France is"),
        tok.encode(pydoc_data.topics.topics["assert"])[:60],
        chat,
    ]


@pytest.mark.slow
def test_greedy_with_and_without_kv_cache_equals_transformers(
    llm: LLM, prompts: list[list[int]], hf_embedded: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert [len(p) for p in prompts][:2] == [5, 60] and len(prompts[2]) > 16
    monkeypatch.setattr(hf_embedded.generation_config, "eos_token_id", None)
    want = hf_greedy(hf_embedded, prompts, NUM_NEW_TOKENS)
    assert all(len(w) == NUM_NEW_TOKENS for w in want)
    assert our_greedy(llm, prompts, NUM_NEW_TOKENS) == want
    # The baseline recomputes every sequence from scratch at every step: one batched call.
    without_cache = LLM(kv_cache_memory="64MiB", use_kv_cache=False, skip_tokenizer_init=True)
    assert our_greedy(without_cache, prompts, NUM_NEW_TOKENS) == want
    assert llm.stats().num_blocks_used == 0
    llm.engine.check_integrity()


def request_slots(engine: LLMEngine, request: Request, num_tokens: int) -> torch.Tensor:
    """Slots of the request's first num_tokens positions, from its block table."""
    bs = engine.kv_storage.block_size
    blocks = torch.tensor(engine.kv_manager.block_ids(request.request_id))
    return (blocks[:, None] * bs + torch.arange(bs)).flatten()[:num_tokens]


def snapshot(engine: LLMEngine, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    kv = engine.kv_storage
    return [(kv.k[i][slots].clone(), kv.v[i][slots].clone()) for i in range(len(kv.k))]


@pytest.mark.slow
def test_cached_kv_is_never_rewritten(llm: LLM, prompts: list[list[int]]) -> None:
    engine = llm.engine
    llm.reset_prefix_cache()
    long_prompt = prompts[1] + prompts[0]  # 65 tokens: 4 full blocks and one started
    first = engine.add_request(long_prompt, greedy(40))
    engine.step()  # the prefill, and the first token
    assert first.num_computed_tokens == len(long_prompt)
    slots = request_slots(engine, first, len(long_prompt))
    before = snapshot(engine, slots)

    # Other requests write their own slots meanwhile: one unrelated, one that shares the first
    # four blocks through the prefix cache (and must read, not rewrite, them).
    engine.add_request(prompts[2], greedy(40))
    sharer = engine.add_request(long_prompt[:64] + prompts[0], greedy(40))
    for _ in range(30):
        engine.step()
    assert len(first.output_token_ids) == 31 and not (first.finished or sharer.finished)
    assert sharer.num_cached_tokens == 64
    kv = engine.kv_manager
    assert kv.block_ids(sharer.request_id)[:4] == kv.block_ids(first.request_id)[:4]
    for layer, ((k0, v0), (k1, v1)) in enumerate(zip(before, snapshot(engine, slots),
                                                     strict=True)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1), f"layer {layer}"
    # The decodes' own K/V, too, stay put once written.
    decoded = request_slots(engine, first, first.num_computed_tokens)
    before = snapshot(engine, decoded)
    while engine.has_unfinished():
        engine.step()
    after = snapshot(engine, decoded)  # freed but still cached, not yet reused
    for layer, ((k0, v0), (k1, v1)) in enumerate(zip(before, after, strict=True)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1), f"layer {layer}"
    assert llm.stats().num_blocks_used == 0
    engine.check_integrity()


@pytest.mark.slow
def test_prefill_kv_equals_transformers_cache(
    llm: LLM, prompts: list[list[int]], hf_embedded: Any
) -> None:
    engine = llm.engine
    llm.reset_prefix_cache()
    prompt = prompts[1]
    request = engine.add_request(prompt, greedy(1))
    batch = engine.scheduler.schedule()
    slots = request_slots(engine, request, len(prompt))
    engine.runner.run(batch)  # the forward writes the slots; nothing else is needed here
    ours = snapshot(engine, slots)
    engine.abort(request.request_id)
    cache = DynamicCache()
    with torch.no_grad():
        hf_embedded(torch.tensor([prompt]), cache=cache, use_cache=True)
    assert len(cache.layers) == len(ours)
    for layer, (k, v) in enumerate(ours):
        # transformers: [batch, H_kv, T, D] (after rope); our slots: [T, H_kv, D]
        want_k = cache.layers[layer].keys[0].transpose(0, 1)
        want_v = cache.layers[layer].values[0].transpose(0, 1)
        torch.testing.assert_close(k, want_k, rtol=0, atol=KV_ATOL, msg=f"K of layer {layer}")
        torch.testing.assert_close(v, want_v, rtol=0, atol=KV_ATOL, msg=f"V of layer {layer}")
    assert llm.stats().num_blocks_used == 0
    engine.check_integrity()


# -- tiny random models of every variant -------------------------------------------------------


def tiny_prompts() -> list[list[int]]:
    """Seeded random prompts (vocab 256): 3 tokens, and two past the llama3 variant's
    original_max_position_embeddings (32) so its rope scaling matters. With 32 new tokens
    the longest sequence ends at 101 of the 128-token context."""
    g = torch.Generator().manual_seed(99)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 40, 70)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_variant_greedy_matches_transformers(tmp_path: Path, variant: str) -> None:
    folder = make_tiny_hf_folder(tmp_path, variant)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # our own model object: nothing to restore
    prompts = tiny_prompts()
    want = hf_greedy(hf, prompts, 32)
    assert all(len(w) == 32 for w in want)
    kwargs: dict[str, Any] = {"skip_tokenizer_init": True, "kv_cache_memory": "4MiB"}
    assert our_greedy(LLM(model=str(folder), **kwargs), prompts, 32) == want
    assert our_greedy(LLM(model=str(folder), use_kv_cache=False, **kwargs), prompts, 32) == want
