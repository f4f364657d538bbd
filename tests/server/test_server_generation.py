"""server/generation.py: a response reads the newest cumulative output, never a backlog."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from kvstack.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvstack.sampling_params import SamplingParams
from kvstack.server.generation import Generation
from kvstack.server.metrics import ServerMetrics


def _output(tokens: list[int], finished: bool) -> RequestOutput:
    text = "".join(f"<{t}>" for t in tokens)
    return RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, tokens, None,
                                                              "length" if finished else None)],
                         finished, 0, RequestMetrics(arrival_time=0.0))


class _Burst:
    """An engine whose outputs arrive together: three steps' worth before the reader runs."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.aborted: list[str] = []

    async def generate(self, prompt: Sequence[int], sampling_params: SamplingParams,
                       request_id: str, *args: Any) -> AsyncIterator[RequestOutput]:
        yield _output([5], False)
        yield _output([5, 6], False)
        if self.fail:
            raise RuntimeError("engine failed")
        yield _output([5, 6, 7], True)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _read_all(engine: _Burst) -> list[RequestOutput | Exception]:
    async def main() -> list[RequestOutput | Exception]:
        stream = Generation(engine, ServerMetrics(engine), [1, 2],  # type: ignore[arg-type]
                            SamplingParams(max_tokens=3), "r", None)
        await asyncio.sleep(0)  # the pump runs: every output is queued before the first read
        seen: list[RequestOutput | Exception] = []
        while not stream.finished:
            try:
                seen.append(await stream.next())
            except RuntimeError as err:
                seen.append(err)
        stream.close()
        return seen

    return asyncio.run(main())


def test_outputs_that_queued_up_are_read_as_the_newest() -> None:
    seen = _read_all(_Burst())
    assert len(seen) == 1
    out = seen[0]
    assert isinstance(out, RequestOutput) and out.finished
    assert out.outputs[0].token_ids == [5, 6, 7] and out.outputs[0].text == "<5><6><7>"


def test_an_error_behind_queued_outputs_still_reaches_the_reader() -> None:
    seen = _read_all(_Burst(fail=True))
    assert len(seen) == 1 and isinstance(seen[0], RuntimeError)
