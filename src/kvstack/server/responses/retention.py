"""An active conversation keeps its K/V in the pool: when a stored response finishes, the
full blocks of its prompt and output are pinned for the server's `responses_pin_ttl_s`
(`kvstack serve --responses-pin-ttl`), and each turn that continues it pins the longer chain
again, refreshing the deadline of the blocks it shares.

The pins are the pool's own (`kv/pins.py`, the ones `cache_control` uses), so they share its
bounded share of the pool (`--max-pinned-fraction`): past it the least recently refreshed
lapse, and a pin never makes a request wait (the pool lapses pins for blocks it must hand
out). Once a conversation is idle past its deadline its blocks are cached blocks like any
other: the LRU may evict them, and the disk or Redis tier holds their copy (written when
they were published), where the next turn restores them from.
"""

from __future__ import annotations

from kvstack.outputs import RequestOutput
from kvstack.server.engine_client import EngineClient
from kvstack.server.generation import OutputStream


class RetainedStream:
    """`stream`, pinning the conversation's blocks once its output is finished (before the
    finished output is answered, so the next turn finds them pinned)."""

    def __init__(self, stream: OutputStream, engine: EngineClient, prompt_ids: list[int],
                 cache_salt: str | None, ttl_s: float) -> None:
        self._stream = stream
        self._engine = engine
        self._prompt_ids = prompt_ids
        self._cache_salt = cache_salt
        self._ttl_s = ttl_s
        self._pinned = False

    @property
    def finished(self) -> bool:
        return self._stream.finished

    async def next(self) -> RequestOutput:
        out = await self._stream.next()
        if out.finished and not self._pinned:
            self._pinned = True
            token_ids = [*self._prompt_ids, *out.outputs[0].token_ids]
            await self._engine.pin_prefix(token_ids, self._cache_salt, self._ttl_s)
        return out

    def close(self) -> None:
        self._stream.close()


def retained(stream: OutputStream, engine: EngineClient, prompt_ids: list[int],
             cache_salt: str | None, ttl_s: float) -> OutputStream:
    """`stream` with its conversation pinned when it finishes; as it is with `ttl_s` 0."""
    if ttl_s <= 0:
        return stream
    return RetainedStream(stream, engine, prompt_ids, cache_salt, ttl_s)
