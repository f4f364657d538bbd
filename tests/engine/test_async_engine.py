"""The asyncio front end: concurrent streams, abort on early exit, errors surface."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvstack import LLM, SamplingParams
from kvstack.engine.async_llm import AsyncLLM, QueueFullError
from kvstack.errors import InvalidRequestError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The capital of France is", "List three colours:", "def add(a, b):", "Water boils at"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory="64MiB")


async def _collect(engine: AsyncLLM, prompt: str, request_id: str) -> list[int]:
    last = None
    async for out in engine.generate(prompt, GREEDY, request_id):
        last = out
    assert last is not None and last.finished
    return last.outputs[0].token_ids


def test_concurrent_streams_match_offline(llm: LLM) -> None:
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    engine = AsyncLLM(llm.engine)

    async def main() -> list[list[int]]:
        jobs = [_collect(engine, p, f"r{i}") for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*jobs)

    try:
        assert asyncio.run(main()) == expected
    finally:
        engine.shutdown()
    assert llm.stats().num_blocks_used == 0
    llm.engine.check_integrity()


def test_leaving_a_stream_early_frees_its_blocks(llm: LLM) -> None:
    engine = AsyncLLM(llm.engine)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main() -> int:
        seen = 0
        async for _ in engine.generate("Tell me a long story.", long, "early"):
            seen += 1
            if seen == 3:
                break
        return seen

    try:
        assert asyncio.run(main()) == 3
        assert engine.num_unfinished() == 0
        assert engine.stats().num_blocks_used == 0
        llm.engine.check_integrity()
    finally:
        engine.shutdown()


def test_bad_request_raises_typed_error_and_engine_keeps_serving(llm: LLM) -> None:
    engine = AsyncLLM(llm.engine)

    async def main() -> list[int]:
        with pytest.raises(InvalidRequestError):
            async for _ in engine.generate("", GREEDY, "empty"):
                pass
        return await _collect(engine, PROMPTS[0], "after")

    try:
        got = asyncio.run(main())
    finally:
        engine.shutdown()
    assert got == llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids


def test_full_queue_answers_queue_full(llm: LLM) -> None:
    engine = AsyncLLM(llm.engine, max_waiting=0)

    async def main() -> None:
        with pytest.raises(QueueFullError):
            async for _ in engine.generate(PROMPTS[0], GREEDY, "q"):
                pass

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert llm.stats().num_blocks_used == 0


def test_a_reader_that_falls_behind_gets_the_newest_output(llm: LLM) -> None:
    """Outputs are cumulative: the ones a busy reader missed are folded into the next it reads,
    which carries every token (the stream does not replay a backlog, one output per step)."""
    expected = llm.generate(PROMPTS[1], GREEDY)[0].outputs[0].token_ids
    engine = AsyncLLM(llm.engine)

    async def main() -> list[list[int]]:
        seen = []
        async for out in engine.generate(PROMPTS[1], GREEDY, "slow"):
            seen.append(list(out.outputs[0].token_ids))
            while len(seen) == 1 and engine.num_unfinished():  # holds the loop: a busy reader
                time.sleep(0.01)
        return seen

    try:
        seen = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(seen) == 2  # the first output, then the finished one with all the rest
    assert seen[1] == expected and seen[0] == expected[: len(seen[0])]
