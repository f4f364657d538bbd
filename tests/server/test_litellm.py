"""litellm, unmodified, against kvstack over real HTTP: an over-long prompt raises its
`ContextWindowExceededError` (which its fallbacks key on) on both its `openai/` and
`anthropic/` routes, and a prompt that fits is answered."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from helpers.app_server import AppServer

from kvstack import LLM
from kvstack.engine.async_llm import AsyncLLM
from kvstack.server.app import create_app

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
import litellm

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, LLM]]:
    llm = LLM(MODEL, kv_cache_memory="32MiB")
    engine = AsyncLLM(llm.engine)
    server = AppServer(create_app(engine))
    yield server.url, llm
    server.stop()
    engine.shutdown()
    llm.engine.check_integrity()
    assert llm.stats().num_blocks_used == 0


@pytest.mark.parametrize("route", ["openai", "anthropic"])
def test_an_over_long_prompt_is_a_context_window_error(served: tuple[str, LLM],
                                                       route: str) -> None:
    url, llm = served
    base = f"{url}/v1" if route == "openai" else url
    words = "word " * llm.engine.info.max_model_len
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model=f"{route}/{MODEL}", api_base=base, api_key="x",
                           messages=[{"role": "user", "content": words}], max_tokens=4,
                           num_retries=0)
    answer = litellm.completion(model=f"{route}/{MODEL}", api_base=base, api_key="x",
                                messages=[{"role": "user", "content": "Say hello."}],
                                max_tokens=4, temperature=0, num_retries=0)
    assert answer.choices[0].message.content
