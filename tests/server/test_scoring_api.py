"""Scoring through the official openai SDK (in process, over ASGI): legacy completions' echo +
logprobs as lm-evaluation-harness sends it (token ids, batches, max_tokens 0), streaming,
vLLM's prompt_logprobs in both APIs, numbers equal to transformers' and to a cold engine's
with the prefix cache on, tenants kept apart, and typed 400s for what cannot be scored."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from kvstack import LLM, SamplingParams
from kvstack.engine.async_llm import AsyncLLM
from kvstack.server.app import create_app

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MODEL = "smollm2-135m"
CONTEXT = ("Answer with one word.\nQuestion: Which planet is known as the red planet?\n"
           "Answer:")
CHOICES = [" Mars", " Venus", " Jupiter", " Saturn"]


class Client:
    def __init__(self, llm: LLM, api_keys: tuple[str, ...] = ()) -> None:
        self.llm = llm
        self.engine = AsyncLLM(llm.engine)
        app = create_app(self.engine, api_keys)
        self.loop = asyncio.new_event_loop()
        self._http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                       base_url="http://kvstack/v1", timeout=300)

    def openai(self, key: str = "x") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url="http://kvstack/v1", api_key=key, max_retries=0,
                                  http_client=self._http)

    def run(self, work: Any) -> Any:
        return self.loop.run_until_complete(work)

    def complete(self, key: str = "x", **kw: Any) -> Any:
        return self.run(self.openai(key).completions.create(**({"model": MODEL} | kw)))

    def close(self) -> None:
        self.loop.run_until_complete(self._http.aclose())
        self.loop.close()
        self.engine.shutdown()


@pytest.fixture(scope="module")
def api() -> Iterator[Client]:
    client = Client(LLM(MODEL, kv_cache_memory="64MiB"), api_keys=("key-a", "key-b"))
    yield client
    client.close()
    client.llm.engine.check_integrity()
    assert client.llm.stats().num_blocks_used == 0


@pytest.fixture(scope="module")
def tokenizer(api: Client) -> Any:
    return api.llm.get_tokenizer()


def _reference(hf: Any, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' log-probabilities [len - 1, V] of each position's successor, and the
    successors' own."""
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].double(), -1)
    return logprobs, logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_echo_scores_the_prompt_alone_as_transformers_does(api: Client, tokenizer: Any,
                                                           hf_embedded: Any) -> None:
    text = CONTEXT + CHOICES[0]
    ids = tokenizer.encode(text)
    r = api.complete("key-a", prompt=text, max_tokens=0, echo=True, logprobs=3,
                     temperature=0)
    choice = r.choices[0]
    assert choice.text == tokenizer.decode(ids)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    full, want = _reference(hf_embedded, ids)
    got = torch.tensor(lp.token_logprobs[1:], dtype=torch.float64)
    assert (got - want).abs().max().item() < 1e-4
    for p, (token, top) in enumerate(zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True)):
        assert top[token] == lp.token_logprobs[p + 1] and 3 <= len(top) <= 4
        best = full[p].topk(3).values
        assert max(top.values()) == pytest.approx(best[0].item(), abs=1e-4)


def test_harness_shaped_batch_shares_its_context_and_matches_a_cold_engine(
        api: Client, tokenizer: Any) -> None:
    context = tokenizer.encode(CONTEXT * 3)  # several full blocks of shared context
    batch = [context + tokenizer.encode(c) for c in CHOICES]
    body = {"max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
    api.complete("key-a", prompt=batch[0], **body)  # the context's scores, now kept
    r = api.complete("key-a", prompt=batch, **body)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens_details.cached_tokens >= 4 * (len(context) // 16 * 16 - 16)
    cold = LLM(MODEL, kv_cache_memory="64MiB", enable_prefix_caching=False)
    for ids, choice in zip(batch, r.choices, strict=True):
        values = choice.logprobs.token_logprobs
        assert len(values) == len(ids) + 1  # the prompt's tokens, then the generated one
        ref = cold.generate({"prompt_token_ids": ids}, SamplingParams(
            max_tokens=1, temperature=0, prompt_logprobs=1))[0].prompt_token_logprobs
        assert max(abs(a - b) for a, b in zip(values[1:len(ids)], ref[1:], strict=True)) < 1e-4
        # The harness's greedy check: each continuation token against its position's best.
        for value, top in zip(values[len(context):-1], choice.logprobs.top_logprobs[
                len(context):-1], strict=True):
            assert value <= max(top.values()) + 1e-6
    api.llm.engine.check_integrity()


def test_streamed_echo_sends_the_prompt_and_its_logprobs_first(api: Client,
                                                               tokenizer: Any) -> None:
    async def collect() -> list[Any]:
        stream = await api.openai("key-a").completions.create(
            model=MODEL, prompt=CONTEXT, max_tokens=3, echo=True, logprobs=1, stream=True,
            temperature=0)
        return [chunk async for chunk in stream]
    chunks = api.run(collect())
    first = chunks[0].choices[0]
    ids = tokenizer.encode(CONTEXT)
    assert first.text == tokenizer.decode(ids)
    assert len(first.logprobs.tokens) == len(ids) and first.logprobs.token_logprobs[0] is None
    whole = api.complete("key-a", prompt=CONTEXT, max_tokens=3, echo=True, logprobs=1,
                         temperature=0)
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == whole.choices[0].text
    values = [v for c in chunks for v in (c.choices[0].logprobs.token_logprobs
                                          if c.choices[0].logprobs else [])]
    # The second request takes the first's blocks as a prefix hit and recomputes the rest in
    # a step of another shape, so its figures agree within the hit's documented 1e-4 (run
    # after the module's earlier tests, both are hits and agree bit for bit).
    again = whole.choices[0].logprobs.token_logprobs
    assert values[0] is None and again[0] is None and len(values) == len(again)
    assert max(abs(a - b) for a, b in zip(values[1:], again[1:], strict=True)) < 1e-4


def test_vllm_prompt_logprobs_in_completions_and_chat(api: Client, tokenizer: Any) -> None:
    r = api.complete("key-a", prompt=CONTEXT, max_tokens=2, temperature=0,
                     extra_body={"prompt_logprobs": 2})
    entries = r.choices[0].model_extra["prompt_logprobs"]
    ids = tokenizer.encode(CONTEXT)
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:], strict=True):
        assert str(token) in entry and 2 <= len(entry) <= 3
        ranks = sorted(v["rank"] for v in entry.values())
        assert ranks[:2] == [1, 2] and all(isinstance(v["decoded_token"], str)
                                           for v in entry.values())
    chat = api.run(api.openai("key-a").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        temperature=0, extra_body={"prompt_logprobs": 0}))
    scored = chat.model_extra["prompt_logprobs"]
    assert scored[0] is None and all(len(e) == 1 for e in scored[1:])


def test_scores_never_cross_tenants(api: Client, tokenizer: Any) -> None:
    ids = tokenizer.encode("Tenant scoring check. " * 12)
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}
    first = api.complete("key-a", **body)
    again = api.complete("key-a", **body)
    other = api.complete("key-b", **body)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    for r in (again, other):
        assert r.choices[0].logprobs.token_logprobs == pytest.approx(
            first.choices[0].logprobs.token_logprobs, abs=1e-4)


@pytest.mark.parametrize("kw, needle", [
    ({"prompt": CONTEXT, "echo": True, "n": 2, "max_tokens": 1}, "echo with n"),
    ({"prompt": CONTEXT, "echo": True, "logprobs": 21, "max_tokens": 1}, "logprobs"),
    ({"prompt": CONTEXT, "max_tokens": 1, "extra_body": {"prompt_logprobs": 21}},
     "prompt_logprobs"),
    ({"prompt": CONTEXT, "max_tokens": 0}, "needs echo"),
    ({"prompt": [[1, 2], []], "echo": True, "max_tokens": 0}, "prompt 1"),
    ({"prompt": [], "max_tokens": 1}, "non-empty"),
    ({"prompt": "x " * 9000, "echo": True, "logprobs": 1, "max_tokens": 0}, "context"),
    ({"prompt": None, "max_tokens": 1, "extra_body": {
        "segments": [{"text": "a"}, {"text": "doc", "chunk": True}], "blend": {},
        "prompt_logprobs": 0}},
     "prompt_logprobs"),
])
def test_what_cannot_be_scored_gets_a_typed_400(api: Client, kw: dict[str, Any],
                                                needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        api.complete("key-a", **kw)
    assert needle in err.value.body["message"]
    api.llm.engine.check_integrity()
