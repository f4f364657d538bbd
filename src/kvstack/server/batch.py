"""A batch of prompts in one /v1/completions request (OpenAI's `prompt` as a list): one
engine request per prompt, read as one stream whose choices are numbered prompt * n + sample,
as OpenAI numbers them."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

from kvstack.outputs import RequestOutput
from kvstack.server.generation import OutputStream


@dataclass
class BatchOutput(RequestOutput):
    """The batch's outputs so far, and each prompt's own (`parts`, in prompt order)."""

    parts: list[RequestOutput] = field(default_factory=list)


def part_of(out: RequestOutput, index: int, n: int) -> RequestOutput:
    """The output of the prompt that choice `index` belongs to."""
    return out.parts[index // n] if isinstance(out, BatchOutput) else out


class BatchStream:
    """Several prompts' output streams as one `OutputStream`. The first `next` waits for every
    prompt's first output (a refusal of any one still gets its status code); later ones
    return as soon as any prompt's stream moves."""

    def __init__(self, request_id: str, streams: list[OutputStream], n: int) -> None:
        self.request_id = request_id
        self.finished = False
        self._streams = streams
        self._n = n
        self._latest: list[RequestOutput] = []
        self._reads: dict[int, asyncio.Future[RequestOutput]] = {}

    async def next(self) -> RequestOutput:
        if not self._latest:
            self._latest = list(await asyncio.gather(*(s.next() for s in self._streams)))
        else:
            for i, out in enumerate(self._latest):
                if not out.finished and i not in self._reads:
                    self._reads[i] = asyncio.ensure_future(self._streams[i].next())
            await asyncio.wait(self._reads.values(), return_when=asyncio.FIRST_COMPLETED)
            for i, read in list(self._reads.items()):
                if read.done():
                    del self._reads[i]
                    self._latest[i] = read.result()
        merged = self._merged()
        self.finished = merged.finished
        return merged

    def _merged(self) -> BatchOutput:
        parts, n = self._latest, self._n
        first = parts[0]
        return BatchOutput(
            request_id=self.request_id, prompt=None, prompt_token_ids=[],
            outputs=[dataclasses.replace(c, index=i * n + c.index)
                     for i, part in enumerate(parts) for c in part.outputs],
            finished=all(p.finished for p in parts),
            num_cached_tokens=sum(p.num_cached_tokens for p in parts),
            metrics=first.metrics, parts=list(parts))

    def close(self) -> None:
        self.finished = True
        for read in self._reads.values():
            read.cancel()
        for stream in self._streams:
            stream.close()
