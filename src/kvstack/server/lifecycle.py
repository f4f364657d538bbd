"""One response lifecycle for both APIs.

`respond` starts from an `OutputStream` (a model run or a semantic-cache replay), waits for
the first output before answering (so refusals such as a full queue still get their status
code; a stream waits at most KEEPALIVE_S, then answers and keeps the connection alive), then
answers whole or as server-sent events, storing a finished answer in the semantic
cache when the request looked it up. The stream is closed (the engine request aborted) on
every path: an error, a client that leaves, a finished answer. Each API supplies a
`WireFormat` that writes its own JSON shapes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvstack.outputs import CompletionOutput, RequestOutput
from kvstack.server.errors import from_exception
from kvstack.server.generation import OutputStream, final_output, unless_disconnected
from kvstack.server.semantic_api import Probe

# A stream whose first token takes longer than this is answered at once (status and
# headers) and sent a comment this often until the token comes: a long prefill on a slow CPU
# must not look like a dead connection to clients with idle timeouts (Claude Code gives up
# on a request that has not answered in a few minutes, then sends it again).
KEEPALIVE_S = 10.0
KEEPALIVE = ": keep-alive\n\n"


class WireFormat(Protocol):
    """How one API writes a response."""

    headers: dict[str, str]  # extra response headers (the semantic cache's hit/miss)

    async def started(self, first: RequestOutput) -> None:
        """The first output is out (the prompt is computed and cached)."""
        ...

    def whole(self, out: RequestOutput) -> dict[str, Any]:
        """The non-streaming response body of a finished output."""
        ...

    def opening(self, first: RequestOutput) -> Iterable[str]:
        """SSE events before the first text."""
        ...

    def delta(self, out: RequestOutput, completion: CompletionOutput, sent_chars: int,
              sent_tokens: int) -> Iterable[str]:
        """Events for what one of `out`'s completions adds past the `sent_chars` characters
        and `sent_tokens` tokens of it already sent (and its finish reason once it has one);
        called until its finish reason has been seen once."""
        ...

    def closing(self, out: RequestOutput) -> Iterable[str]:
        """Events after the finished output (usage, stop reasons)."""
        ...

    def error(self, body: dict[str, Any]) -> str:
        """An in-band error event: the status line is long gone once a stream has begun."""
        ...

    def done(self) -> Iterable[str]:
        """Events that end every stream, after an error too."""
        ...

    def keepalive(self) -> str:
        """What a stream answered before its first token is sent every KEEPALIVE_S: an
        event the API defines where clients' idle timers count only events (Anthropic's
        `ping`, the Responses API's `response.in_progress`), else an SSE comment."""
        ...


async def respond(request: Request, stream: OutputStream, wire: WireFormat, streaming: bool,
                  probe: Probe | None) -> JSONResponse | StreamingResponse:
    pending = asyncio.ensure_future(stream.next())
    try:
        first = await unless_disconnected(request, _within(pending, KEEPALIVE_S if streaming
                                                           else None))
        if first is None:  # a stream whose first token is slow: answer now, keep it alive
            return StreamingResponse(_late_events(request, stream, wire, pending, probe),
                                     media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", **wire.headers})
        await wire.started(first)
        if not streaming:
            out = await unless_disconnected(request, final_output(stream, first))
            if probe is not None:
                await probe.store(out)
            return JSONResponse(wire.whole(out), headers=wire.headers)
    except BaseException:
        pending.cancel()
        stream.close()
        raise
    finally:
        if not streaming:
            stream.close()
    return StreamingResponse(_events(request, stream, wire, first, probe),
                             media_type="text/event-stream",
                             headers={"cache-control": "no-cache", **wire.headers})


async def _within(pending: asyncio.Future[RequestOutput],
                  timeout_s: float | None) -> RequestOutput | None:
    """`pending`'s output, or None if it is not there within `timeout_s` (None: wait)."""
    done, _ = await asyncio.wait({pending}, timeout=timeout_s)
    return pending.result() if done else None


async def _late_events(request: Request, stream: OutputStream, wire: WireFormat,
                       pending: asyncio.Future[RequestOutput],
                       probe: Probe | None) -> AsyncIterator[str]:
    """The events of a stream answered before its first token: the wire's keep-alive
    every KEEPALIVE_S until the token comes, then as usual; the request's error, if it
    fails before, in-band."""
    try:
        while not (await asyncio.wait({pending}, timeout=KEEPALIVE_S))[0]:
            yield wire.keepalive()
        first = pending.result()
        await wire.started(first)
    except Exception as err:
        stream.close()
        yield wire.error(json.loads(bytes(from_exception(request.url.path, err).body)))
        for event in wire.done():
            yield event
        return
    except BaseException:  # the client left
        pending.cancel()
        stream.close()
        raise
    async for event in _events(request, stream, wire, first, probe):
        yield event


async def _events(request: Request, stream: OutputStream, wire: WireFormat,
                  out: RequestOutput, probe: Probe | None) -> AsyncIterator[str]:
    try:
        for event in wire.opening(out):
            yield event
        sent: dict[int, tuple[int, int]] = {}  # per completion index: (chars, tokens) sent
        done: set[int] = set()  # completions whose finish reason has been written
        while True:
            for completion in out.outputs:
                if completion.index in done:
                    continue
                chars, tokens = sent.get(completion.index, (0, 0))
                for event in wire.delta(out, completion, chars, tokens):
                    yield event
                sent[completion.index] = (len(completion.text), len(completion.token_ids))
                if completion.finish_reason is not None:
                    done.add(completion.index)
            if out.finished:
                break
            out = await stream.next()
        if probe is not None:
            await probe.store(out)
        for event in wire.closing(out):
            yield event
    except Exception as err:  # the status line is gone: say it in-band
        yield wire.error(json.loads(bytes(from_exception(request.url.path, err).body)))
    finally:
        stream.close()
    for event in wire.done():
        yield event


def sse(payload: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event carrying `payload` as JSON."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload, ensure_ascii=False)}\n\n"
