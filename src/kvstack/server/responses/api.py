"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, GET
/v1/responses/{id}/input_items.

A request becomes one engine request through the machinery chat completions use: the chat
template, function tools (server/tools.py; a named `tool_choice` is a required call of that
tool), `text.format` through server/structured.py, the response lifecycle of
server/lifecycle.py and the tenant's cache salt. Stored responses (`store.py`, or
`sqlite_store.py` with `ServerConfig.responses_db`) belong to their tenant;
`previous_response_id` continues one (`prompt.py`), and a stored conversation's blocks stay
pinned while it is active (`retention.py`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvstack.outputs import RequestOutput
from kvstack.server.auth import AuthTenant, tenant_id
from kvstack.server.body import parse_body
from kvstack.server.errors import ApiError
from kvstack.server.lifecycle import respond
from kvstack.server.reasoning import thinking_of
from kvstack.server.responses.items import (
    Conversation,
    ResponsesRequest,
    input_items,
    refuse_unsupported,
    response_format,
)
from kvstack.server.responses.listing import listed, page
from kvstack.server.responses.prompt import Prompt, build_prompt, request_tools
from kvstack.server.responses.retention import retained
from kvstack.server.responses.store import Store, StoredResponse, token_array
from kvstack.server.responses.tool_kinds import check_include, check_reasoning, offered_tools
from kvstack.server.responses.wire import Keep, ResponsesWire
from kvstack.server.state import ServerState, server_state
from kvstack.server.structured import structured_outputs

router = APIRouter()


@router.post("/v1/responses", response_model=None)
async def create_response(request: Request,
                          tenant: AuthTenant) -> JSONResponse | StreamingResponse:
    state = server_state(request)
    body = refuse_unsupported(await parse_body(request, ResponsesRequest))
    state.check_model(body.model)
    check_include(body.include)
    echo = _echo(body, check_reasoning(body.reasoning))
    offered = offered_tools(body.tools, body.tool_choice)
    body = body.model_copy(update={"tools": offered.functions})
    store, owner = response_store(request), tenant_id(tenant)
    previous = None
    if body.previous_response_id is not None:
        previous = store.get(owner, body.previous_response_id)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
    tools = request_tools(body)
    items = input_items(body.input)
    prompt = build_prompt(state.tokenizer, body, tools, previous, items)
    structured = structured_outputs(body, response_format(body.text),
                                    tool_constraint=tools.constraint if tools else None)
    params = state.sampling_params(body, _max_tokens(state, body, prompt),
                                   structured_outputs=structured)
    listing = (*_history(previous), *listed(items))
    keep = _keeper(store, owner, prompt, listing) if body.store else _forget
    wire = ResponsesWire(state.model_name, echo, tools.use if tools else None,
                         len(prompt.token_ids), keep, offered.namespace_of,
                         thinking=thinking_of(state.tokenizer, prompt.token_ids),
                         tokenizer=state.tokenizer)
    wire.headers.update(offered.warning())
    salt = tenant.cache_salt(body.cache_salt)
    stream = state.start(prompt.token_ids, params, wire.id, salt)
    if body.store:  # store: false keeps nothing, its blocks included
        stream = retained(stream, state.engine, prompt.token_ids, salt,
                          state.config.responses_pin_ttl_s)
    return await respond(request, stream, wire, bool(body.stream), None)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request,
                       tenant: AuthTenant) -> dict[str, Any]:
    stored = response_store(request).get(tenant_id(tenant), response_id)
    if stored is None:
        raise _not_found(response_id, "response_id")
    return stored.body


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, tenant: AuthTenant,
                           limit: int = 20, order: str = "desc",
                           after: str | None = None) -> dict[str, Any]:
    stored = response_store(request).get(tenant_id(tenant), response_id)
    if stored is None:
        raise _not_found(response_id, "response_id")
    return page(stored.items, limit, order, after)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request,
                          tenant: AuthTenant) -> dict[str, Any]:
    if not response_store(request).delete(tenant_id(tenant), response_id):
        raise _not_found(response_id, "response_id")
    return {"id": response_id, "object": "response", "deleted": True}


def response_store(request: Request) -> Store:
    """The app's store (`create_app` opens it): in memory, or the SQLite file
    `ServerConfig.responses_db` names."""
    store: Store = request.app.state.responses_store
    return store


def _history(previous: StoredResponse | None) -> tuple[dict[str, Any], ...]:
    """The listed items before a continued turn's input: the previous response's own, then
    its output."""
    if previous is None:
        return ()
    return (*previous.items, *previous.body["output"])


def _not_found(response_id: str, param: str) -> ApiError:
    # One message for unknown, deleted, unstored and other tenants' ids alike.
    return ApiError(404, f"response {response_id!r} not found", param=param)


def _max_tokens(state: ServerState, body: ResponsesRequest, prompt: Prompt) -> int | None:
    context = state.max_model_len
    if body.previous_response_id is not None and not state.unbounded_context \
            and len(prompt.token_ids) >= context:
        raise ApiError(400, f"the conversation continued from previous_response_id is "
                            f"{len(prompt.token_ids)} tokens with this input, over the model's "
                            f"context of {context}; start a new conversation",
                       param="previous_response_id", code="context_length_exceeded")
    return state.max_tokens(body.max_output_tokens, len(prompt.token_ids), api="responses")


def _keeper(store: Store, owner: str, prompt: Prompt,
            listing: tuple[dict[str, Any], ...]) -> Keep:
    def keep(body: dict[str, Any], out: RequestOutput) -> None:
        completion = out.outputs[0]
        calls = {item["call_id"] for item in body["output"] if item["type"] == "function_call"}
        # The output joins the conversation as the model wrote it (its call blocks included),
        # so the next turn reads the same tokens the prefix cache holds.
        talk = Conversation([*prompt.conversation.messages,
                             {"role": "assistant", "content": completion.text}],
                            prompt.conversation.call_ids | calls)
        store.put(owner, StoredResponse(body, talk, token_array(prompt.token_ids),
                                        token_array(completion.token_ids), completion.text,
                                        listing))
    return keep


def _forget(body: dict[str, Any], out: RequestOutput) -> None:
    return None  # store: false keeps nothing


def _echo(body: ResponsesRequest, reasoning: dict[str, Any]) -> dict[str, Any]:
    """The request's fields a response object repeats (its tools as sent)."""
    return {
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls
        is not False, "previous_response_id": body.previous_response_id,
        "reasoning": reasoning, "store": body.store,
        "temperature": body.temperature, "top_p": body.top_p,
        "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
        "truncation": body.truncation or "disabled", "user": body.user, "background": False,
    }
