"""The official SDKs against a server app in this process, over ASGI (no socket): one event
loop, an `AsyncLLM` over the given `LLM`, and clients sharing the app."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import anthropic
import httpx
import httpx2
import openai

from kvstack import LLM
from kvstack.engine.async_llm import AsyncLLM
from kvstack.server.app import create_app

URL = "http://kvstack"


class AsgiClients:
    """`openai` (AsyncOpenAI), `claude` (AsyncAnthropic) and raw `http`, each sending `key`."""

    def __init__(self, llm: LLM, api_keys: Sequence[str] = (), key: str = "x") -> None:
        self.llm = llm
        self.engine = AsyncLLM(llm.engine)
        app = create_app(self.engine, api_keys)
        self.loop = asyncio.new_event_loop()
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=URL,
                                      timeout=300)
        self.openai = openai.AsyncOpenAI(base_url=f"{URL}/v1", api_key=key, max_retries=0,
                                         http_client=self.http)
        self.claude = anthropic.AsyncAnthropic(
            base_url=URL, api_key=key, max_retries=0,
            http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                           base_url=URL, timeout=300))

    def run(self, work: Any) -> Any:
        return self.loop.run_until_complete(work)

    def close(self, pins: bool = False) -> None:
        """Close the clients and the engine; no KV block may be left held (`pins`: but by
        the `cache_control` pins the requests asked for)."""
        self.run(self.openai.close())
        self.run(self.claude.close())
        self.loop.close()
        self.engine.shutdown()
        self.llm.engine.check_integrity()
        stats = self.llm.stats()
        assert stats.num_blocks_used == (stats.num_blocks_pinned if pins else 0)
