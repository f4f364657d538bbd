"""What the coding-agent CLIs send, over ASGI in process: Anthropic system messages inside
`messages`, `thinking` / `context_management` / `output_config`, context overflows in each
API's own words, and the Responses fields Codex sends (`reasoning`, `include`, `namespace`
tools, hosted tools); every refusal a typed 4xx and no KV block left behind."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.asgi_clients import AsgiClients

from kvstack import LLM
from kvstack.server import lifecycle
from kvstack.server.chat_roles import fit_roles, has_system_role, place_system_turns

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "Say hello."}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# Gemma 3's chat template, cut to its handling of roles: a leading system message opens the
# first user turn, and there is no system turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first = "
    "messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}"
    "{%- set first = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}{%- if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) -%}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{%- endif -%}{%- set role = 'model' if "
    "message['role'] == 'assistant' else message['role'] -%}{{ '<start_of_turn>' + role + "
    "'\n' + (first if loop.first else '') + message['content'] + '<end_of_turn>\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")


class Clients(AsgiClients):
    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self.run(self.http.post(path, json=body))

    def message(self, **kw: Any) -> Any:
        return self.post("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": ASK,
                                          "temperature": 0} | kw)

    def response(self, **kw: Any) -> Any:
        return self.post("/v1/responses", {"model": MODEL, "input": "Say hello.",
                                           "max_output_tokens": 8, "temperature": 0,
                                           "store": False} | kw)


@pytest.fixture(scope="module")
def api() -> Iterator[Clients]:
    clients = Clients(LLM(MODEL, kv_cache_memory="64MiB"))
    yield clients
    clients.close()


def _anthropic_error(r: Any, status: int = 400) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return str(body["error"]["message"])


def _openai_error(r: Any, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error: dict[str, Any] = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


# -- Anthropic ---------------------------------------------------------------------------------


def test_system_messages_inside_messages_are_placed_where_they_stand(api: Clients) -> None:
    talk = [{"role": "user", "content": "Hi."},
            {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]},
            {"role": "user", "content": "Say hello."}]
    r = api.message(messages=talk)
    assert r.status_code == 200, r.text
    count = api.post("/v1/messages/count_tokens", {"model": MODEL, "messages": talk}).json()
    without = api.post("/v1/messages/count_tokens",
                       {"model": MODEL, "messages": [talk[0], talk[2]]}).json()
    assert count["input_tokens"] > without["input_tokens"]
    # ChatML has a system role: the message renders as a system turn between the two.
    tokenizer = api.llm.engine.tokenizer
    assert has_system_role(tokenizer)
    rendered = [{"role": m["role"], "content": "x"} for m in talk]
    assert place_system_turns(tokenizer, rendered) == rendered


def test_a_template_without_a_system_role_folds_them_into_the_next_user_turn(
        api: Clients) -> None:
    gemma = copy.deepcopy(api.llm.engine.tokenizer)
    gemma.chat_template = GEMMA_TEMPLATE
    assert not has_system_role(gemma)
    talk = [{"role": "system", "content": "S0"}, {"role": "user", "content": "U1"},
            {"role": "system", "content": "S1"}, {"role": "assistant", "content": "A1"},
            {"role": "system", "content": "S2"}, {"role": "user", "content": "U2"},
            {"role": "system", "content": "S3"}]
    assert place_system_turns(gemma, talk) == [
        {"role": "system", "content": "S0"}, {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "S1\n\nS2\n\nU2\n\nS3"}]


def test_thinking_and_context_management_are_accepted_and_reported(api: Clients) -> None:
    for thinking in ({"type": "adaptive", "display": "omitted"}, {"type": "disabled"},
                     {"type": "enabled", "budget_tokens": 1024}):
        r = api.message(max_tokens=1100 if thinking["type"] == "enabled" else 8,
                        thinking=thinking, output_config={"effort": "high"},
                        metadata={"user_id": "u"}, context_management={"edits": [
                            {"type": "clear_thinking_20251015", "keep": "all"}]},
                        stop_sequences=[".", "!", "\n"])
        body = r.json()
        assert r.status_code == 200, r.text
        assert [b["type"] for b in body["content"]] == ["text"]  # never a thinking block
        assert body["context_management"] == {"applied_edits": []}
    assert "context_management" not in api.message().json()


@pytest.mark.parametrize("kw, needle", [
    ({"thinking": {"type": "enabled", "budget_tokens": 4096}, "max_tokens": 4096},
     "`max_tokens` must be greater than `thinking.budget_tokens`"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}, "max_tokens": 4096},
     "greater than or equal to 1024"),
    ({"thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"thinking": {"type": "deep"}}, "thinking.type"),
    ({"context_management": {"edits": [{"type": "forget_everything"}]}}, "edits.0.type"),
    ({"system": [{"type": "text"}]}, "needs 'text'"),
    ({"system": [{"type": "image", "source": {"type": "base64", "data": "AA"}}]},
     "'image' is not supported"),
    ({"messages": [{"role": "user", "content": "Hi."}, {"role": "system", "content": [
        {"type": "image", "source": {"type": "base64", "data": "AA"}}]}]},
     "a system message takes text blocks only"),
    ({"messages": [{"role": "system", "content": []}]}, "content is empty"),
])
def test_bad_anthropic_fields_get_a_typed_400(api: Clients, kw: dict[str, Any],
                                             needle: str) -> None:
    assert needle in _anthropic_error(api.message(**kw))
    api.llm.engine.check_integrity()


def test_anthropic_overflows_use_anthropics_words(api: Clients) -> None:
    context = api.llm.engine.info.max_model_len
    short = api.message(max_tokens=context)
    n = api.post("/v1/messages/count_tokens", {"model": MODEL, "messages": ASK}).json()
    n = n["input_tokens"]
    assert _anthropic_error(short) == (
        f"input length and `max_tokens` exceed context limit: {n} + {context} > {context}, "
        "decrease input length or `max_tokens` and try again")
    long = api.message(messages=[{"role": "user", "content": "word " * context}])
    message = _anthropic_error(long)
    assert message.startswith("prompt is too long: ") and message.endswith(
        f" tokens > {context} maximum")
    # Exactly filling the context is not an overflow (the pool, not the context, may
    # still refuse it).
    assert "context limit" not in api.message(max_tokens=context - n).text


# -- OpenAI ------------------------------------------------------------------------------------


def test_openai_overflows_say_context_length_exceeded(api: Clients) -> None:
    context = api.llm.engine.info.max_model_len
    chat = api.post("/v1/chat/completions", {"model": MODEL, "messages": ASK,
                                             "max_tokens": context})
    error = _openai_error(chat)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert error["message"].startswith(f"This model's maximum context length is {context} "
                                       "tokens. However, you requested ")
    long = api.post("/v1/completions", {"model": MODEL, "prompt": "word " * context})
    error = _openai_error(long)
    assert error["code"] == "context_length_exceeded"
    assert "maximum context length" in error["message"] and "your prompt resulted in" \
        in error["message"]
    error = _openai_error(api.response(max_output_tokens=context))
    assert error["code"] == "context_length_exceeded" and error["param"] == "input"


def test_responses_accept_reasoning_and_include_without_reasoning_items(api: Clients) -> None:
    r = api.response(reasoning={"summary": "auto"}, include=["reasoning.encrypted_content"],
                     store=False, prompt_cache_key="k", parallel_tool_calls=True)
    body = r.json()
    assert r.status_code == 200, r.text
    assert [item["type"] for item in body["output"]] == ["message"]
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    assert body["reasoning"] == {"effort": None, "summary": "auto"}


def test_namespace_tools_are_flattened_and_calls_keep_their_namespace(api: Clients) -> None:
    tools = [{"type": "namespace", "name": "weather", "description": "Weather tools",
              "tools": [{"type": "function", "name": "get_weather", "parameters": CITY}]},
             {"type": "function", "name": "get_time", "parameters": CITY},
             {"type": "web_search", "external_web_access": False}]
    r = api.response(tools=tools, tool_choice={"type": "function", "name": "get_weather"},
                     max_output_tokens=40)
    body = r.json()
    assert r.status_code == 200, r.text
    calls = [item for item in body["output"] if item["type"] == "function_call"]
    assert calls and all(c["name"] == "get_weather" and c["namespace"] == "weather"
                         for c in calls)
    assert "web_search" in r.headers["warning"] and "left out" in r.headers["warning"]
    assert body["tools"] == tools  # echoed as sent
    plain = api.response(tools=tools[1:2], tool_choice="required", max_output_tokens=40)
    assert plain.status_code == 200 and "warning" not in plain.headers
    assert all("namespace" not in item for item in plain.json()["output"])


@pytest.mark.parametrize("kw, param, needle", [
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
     "tool_choice", "cannot run"),
    ({"tools": [{"type": "namespace", "name": "empty", "tools": []}]}, "tools", "has no tools"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}]},
     "tools", "namespace holds function tools"),
    ({"tools": [{"type": "teleport"}]}, "tools", "'teleport' is not supported"),
    ({"include": ["everything"]}, "include", "not a supported value"),
    ({"reasoning": {"effort": "maximal"}}, "reasoning", "reasoning.effort"),
])
def test_bad_responses_tools_get_a_typed_400(api: Clients, kw: dict[str, Any], param: str,
                                            needle: str) -> None:
    error = _openai_error(api.response(**kw))
    assert error["param"] == param and needle in error["message"]
    api.llm.engine.check_integrity()


# -- slow first tokens -------------------------------------------------------------------------


def test_a_stream_with_a_slow_first_token_is_answered_at_once_and_kept_alive(
        api: Clients, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle, "KEEPALIVE_S", 0.001)  # any prefill is "slow" now
    long = [{"role": "user", "content": "Tell me about the sea. " * 40}]
    r = api.message(messages=long, stream=True)
    events = [line.split(": ", 1)[1] for line in r.text.splitlines()
              if line.startswith("event: ")]
    assert r.status_code == 200 and events[0] == "ping"  # Anthropic's own keep-alive
    assert events[events.index("message_start") - 1] == "ping" and events[-1] == "message_stop"
    r = api.response(input="Tell me about the sea. " * 40, stream=True)
    kinds = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.in_progress"]
    assert kinds.count("response.created") == 1 and kinds[-1] == "response.incomplete"

    async def read_all() -> tuple[str, str, Any]:
        stream = await api.openai.chat.completions.create(
            model=MODEL, messages=long, max_tokens=4, temperature=0, stream=True)
        chat = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        async with api.claude.messages.stream(model=MODEL, max_tokens=4, messages=long
                                              ) as messages:
            text = "".join([t async for t in messages.text_stream])
        events = await api.openai.responses.create(model=MODEL, input=long[0]["content"],
                                                   max_output_tokens=4, store=False,
                                                   stream=True)
        return chat, text, [e async for e in events][-1]
    chat, text, last = api.run(read_all())  # each SDK reads past the keep-alives
    assert chat and text and last.response.usage.output_tokens == 4
    late = api.message(messages=long, stream=True, max_tokens=10**6)  # refused before any
    assert late.status_code == 400  # token: still a status code, not an in-band error
    api.llm.engine.check_integrity()


def test_a_conversation_the_template_refuses_is_fitted_to_its_roles(api: Clients) -> None:
    gemma = copy.deepcopy(api.llm.engine.tokenizer)
    gemma.chat_template = GEMMA_TEMPLATE
    codex = [{"role": "system", "content": "D1"}, {"role": "system", "content": "D2"},
             {"role": "user", "content": "U1"}, {"role": "user", "content": "U2"},
             {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U3"}]
    assert fit_roles(gemma, codex) == [
        {"role": "system", "content": "D1"}, {"role": "user", "content": "D2\n\nU1\n\nU2"},
        {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U3"}]
    # ChatML renders them as sent: nothing is fitted there.
    r = api.response(input=[{"type": "message", "role": "developer", "content": "D1"},
                            {"type": "message", "role": "developer", "content": "D2"},
                            {"type": "message", "role": "user", "content": "U1"},
                            {"type": "message", "role": "user", "content": "U2"}])
    assert r.status_code == 200, r.text
