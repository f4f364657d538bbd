"""The Responses API through the official `openai` SDK and an OpenAI Agents SDK agent, over
real HTTP: whole and streamed responses (the typed event sequence), function tools, stored
responses continued by `previous_response_id` as exact prefix-cache hits, `store: false`,
retrieve and delete, tenants that cannot see each other's responses, and typed 400/404s."""

from __future__ import annotations

import asyncio
import json
from array import array
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from helpers.app_server import AppServer

from kvstack import LLM
from kvstack.engine.async_llm import AsyncLLM
from kvstack.server.app import create_app
from kvstack.server.auth import Tenant, tenant_id
from kvstack.server.responses.items import Conversation, ResponsesRequest, input_items
from kvstack.server.responses.prompt import build_prompt
from kvstack.server.responses.store import ResponseStore, StoredResponse

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MODEL = "smollm2-135m"
KEY_A, KEY_B = "key-a-responses", "key-b-responses"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather of a city",
          "parameters": CITY},
         {"type": "function", "name": "get_time", "description": "Local time of a city",
          "parameters": CITY}]
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 24}


class Served:
    def __init__(self) -> None:
        self.llm = LLM(MODEL, kv_cache_memory="64MiB")
        self.engine = AsyncLLM(self.llm.engine)
        self.app = create_app(self.engine, api_keys=[KEY_A, KEY_B])
        self.server = AppServer(self.app)
        self.url = self.server.url
        self.block_size = self.engine.info.block_size

    def client(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0,
                             timeout=300)

    def post(self, body: dict[str, Any], key: str = KEY_A) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/responses", json=body, timeout=300,
                          headers={"authorization": f"Bearer {key}"})

    def close(self) -> None:
        self.server.stop()
        self.engine.shutdown()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()
    s.llm.engine.check_integrity()
    stats = s.llm.stats()
    assert stats.num_blocks_used == stats.num_blocks_pinned  # stored conversations' pins


# -- no model needed ---------------------------------------------------------------------------


def _stored(response_id: str) -> StoredResponse:
    return StoredResponse({"id": response_id}, Conversation([], frozenset()), array("i"),
                          array("i"), "")


def test_the_store_is_per_tenant_and_drops_its_oldest() -> None:
    store = ResponseStore(max_entries=2)
    for name in ("r1", "r2", "r3"):
        store.put("a", _stored(name))
    assert store.get("a", "r1") is None and store.get("a", "r3") is not None
    assert store.get("b", "r3") is None and not store.delete("b", "r3")
    assert store.delete("a", "r3") and store.get("a", "r3") is None and len(store) == 1


# -- the openai SDK ----------------------------------------------------------------------------


def test_plain_response_then_retrieve(served: Served) -> None:
    client = served.client()
    r = client.responses.create(input="What is the capital of France?", **GREEDY)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    [message] = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and r.output_text.strip()
    usage = r.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens_details.cached_tokens >= 0
    again = client.responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == r.output_text


def test_item_input_with_instructions_parts_and_roles(served: Served) -> None:
    items = [{"role": "developer", "content": "Answer in one word."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Name a colour."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
             {"role": "user", "content": "Another one?"}]
    r = served.client().responses.create(input=items, instructions="Be brief.", **GREEDY)
    assert r.output_text.strip() and r.instructions == "Be brief."


def test_streamed_events_in_order_and_the_same_text(served: Served) -> None:
    events = list(served.client().responses.create(input="Say hello.", stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text and text == final.output_text
    assert next(e for e in events if e.type == "response.output_text.done").text == text
    assert served.client().responses.retrieve(final.id).output_text == text


@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "get_weather"},
                                         "required"])
def test_tools_give_a_function_call_with_parsed_arguments(served: Served,
                                                          tool_choice: Any) -> None:
    kw = {"input": "What is the weather in Paris?", "tools": TOOLS,
          "tool_choice": tool_choice, **GREEDY, "max_output_tokens": 60}
    r = served.client().responses.create(**kw)
    [call] = r.output
    assert call.type == "function_call" and call.call_id.startswith("call_")
    assert call.name in ("get_weather", "get_time")
    if isinstance(tool_choice, dict):
        assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY)
    events = list(served.client().responses.create(stream=True, **kw))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["function_call"]
    delta = "".join(e.delta for e in events
                    if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert delta == done.arguments == events[-1].response.output[0].arguments
    jsonschema.validate(json.loads(done.arguments), CITY)


def _exact_hit(served: Served, previous: Any) -> int:
    """Cached tokens a turn continuing `previous` must find: every full block of its prompt
    and output but the last token, whose K/V was never computed."""
    computed = previous.usage.input_tokens + previous.usage.output_tokens - 1
    return computed // served.block_size * served.block_size


def test_previous_response_id_chains_hit_the_stored_tokens(served: Served) -> None:
    client = served.client()
    first = client.responses.create(input="What is the weather in Oslo?", tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    **{**GREEDY, "max_output_tokens": 60})
    [call] = first.output
    second = client.responses.create(
        previous_response_id=first.id, tools=TOOLS, **GREEDY,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "Oslo: 7 degrees, rain"}])
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= _exact_hit(served, first) > 0
    third = client.responses.create(previous_response_id=second.id, tools=TOOLS,
                                    input="Thanks. And tomorrow?", **GREEDY)
    assert third.usage.input_tokens_details.cached_tokens >= _exact_hit(served, second)
    assert _exact_hit(served, second) > _exact_hit(served, first)


def test_store_false_keeps_nothing(served: Served) -> None:
    client = served.client()
    r = client.responses.create(input="Hi!", store=False, **GREEDY)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="Again?", previous_response_id=r.id, **GREEDY)


def test_deleted_and_foreign_responses_are_not_found_alike(served: Served) -> None:
    mine = served.client().responses.create(input="Hello.", **GREEDY)
    other = served.client(KEY_B)
    bodies = []
    for response_id, key in ((mine.id, KEY_B), ("resp_unknown", KEY_A)):
        got = httpx.get(f"{served.url}/v1/responses/{response_id}", timeout=30,
                        headers={"authorization": f"Bearer {key}"})
        assert got.status_code == 404
        bodies.append(got.json()["error"])
    assert {b["type"] for b in bodies} == {"not_found_error"}
    assert bodies[0]["message"].replace(mine.id, "X") == \
        bodies[1]["message"].replace("resp_unknown", "X")
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(input="Go on.", previous_response_id=mine.id, **GREEDY)
    served.client().responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        served.client().responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        served.client().responses.delete(mine.id)
    missing = served.post({"input": "Go on.", "previous_response_id": mine.id, **GREEDY})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == \
        "previous_response_id"


CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
        "arguments": '{"city": "Rome"}'}


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
     "tool_choice"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}],
      "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tools": [{"type": "computer"}]}, "tools"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "maximal"}}, "reasoning"),
    ({"input": []}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
     "input"),
    ({"input": [CALL, {"type": "function_call_output", "call_id": "call_2", "output": "1"}]},
     "input"),
    ({"input": [{**CALL, "arguments": "[1]"}]}, "input"),
    ({"input": 5}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, None),
    ({"truncation": "auto"}, "truncation"),
])
def test_bad_requests_get_a_typed_400(served: Served, fields: dict[str, Any],
                                      param: str | None) -> None:
    r = served.post({"input": "Hi", **GREEDY, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_a_chain_longer_than_the_context_is_a_400(served: Served) -> None:
    context = served.engine.info.max_model_len
    talk = Conversation([{"role": "user", "content": "word " * context},
                         {"role": "assistant", "content": "ok"}], frozenset())
    store = served.app.state.responses_store
    store.put(tenant_id(Tenant(KEY_A)), StoredResponse(
        {"id": "resp_long"}, talk, array("i"), array("i"), "ok"))
    r = served.post({"input": "Go on.", "previous_response_id": "resp_long", **GREEDY})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_a_turn_continues_the_stored_tokens_only_under_the_same_instructions(
        served: Served) -> None:
    tokenizer = served.engine.tokenizer
    first = ResponsesRequest(model=MODEL, input="Hi", instructions="Be brief.")
    prompt = build_prompt(tokenizer, first, None, None, input_items(first.input))
    output = tokenizer.encode("Hello!", add_special_tokens=False) + [tokenizer.eos_token_id]
    talk = Conversation([*prompt.conversation.messages,
                         {"role": "assistant", "content": "Hello!"}], frozenset())
    stored = StoredResponse({"id": "r"}, talk, array("i", prompt.token_ids),
                            array("i", output), "Hello!")
    for instructions, continued in (("Be brief.", True), ("Be verbose.", False)):
        turn = ResponsesRequest(model=MODEL, input="Bye", instructions=instructions)
        again = build_prompt(tokenizer, turn, None, stored, input_items(turn.input))
        assert again.continued is continued
        head = [*prompt.token_ids, *output]
        assert (again.token_ids[:len(head)] == head) is continued


def test_json_schema_text_format(served: Served) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}},
              "required": ["answer"], "additionalProperties": False}
    r = served.client().responses.create(
        input="Capital of Italy?", **{**GREEDY, "max_output_tokens": 40},
        text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


# -- the OpenAI Agents SDK ---------------------------------------------------------------------


def test_an_agent_with_two_tools_over_several_turns(served: Served) -> None:
    set_tracing_disabled(True)
    calls: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append(("get_weather", city))
        return f"{city}: 18 degrees, sunny"

    @function_tool
    def get_time(city: str) -> str:
        """Local time of a city."""
        calls.append(("get_time", city))
        return f"{city}: 14:05"

    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=KEY_A, max_retries=0,
                                timeout=300)
    # The tiny model would rarely call a tool on its own: each run forces its first call
    # (the SDK then resets tool_choice, so the next turn answers from the tool's result).
    def settings(tool: str) -> ModelSettings:
        return ModelSettings(tool_choice=tool, temperature=0, max_tokens=40)

    agent = Agent(name="assistant", instructions="Answer with the tool's result.",
                  tools=[get_weather, get_time], model=OpenAIResponsesModel(MODEL, client),
                  model_settings=settings("get_weather"))

    async def conversation() -> tuple[Any, Any, list[str | None]]:
        first = await Runner.run(agent, "What is the weather in Paris?")
        second = Runner.run_streamed(agent.clone(model_settings=settings("get_time")),
                                     "And what time is it in Tokyo?",
                                     previous_response_id=first.last_response_id)
        kinds = [getattr(e.data, "type", None) async for e in second.stream_events()
                 if e.type == "raw_response_event"]
        await client.close()
        return first, second, kinds

    first, second, kinds = asyncio.run(conversation())
    assert {"response.function_call_arguments.done", "response.output_text.delta",
            "response.completed"} <= set(kinds)
    assert calls == [("get_weather", "Paris"), ("get_time", "Tokyo")]
    assert "18 degrees" in first.final_output
    assert "14:05" in second.final_output
    # Each model call after the first continues a stored response: its tokens are cached.
    later = [*first.raw_responses[1:], *second.raw_responses]
    assert all(r.usage.input_tokens_details.cached_tokens > 0 for r in later)
