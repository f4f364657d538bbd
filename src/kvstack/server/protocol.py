"""Request bodies of the OpenAI and Anthropic APIs, plus vLLM's extra sampling fields.

Validation is strict (no "5" -> 5, no true -> 1); unknown fields are ignored, as vLLM does.
Value ranges are left to `SamplingParams`, so every entry point refuses the same values.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ExtraSampling(_Body):
    """vLLM-style fields both APIs accept, the prefix-cache salt and the semantic-cache
    switch."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    # true: a sampled request may use the semantic cache too; false: not even a greedy one.
    semantic_cache: bool | None = None
    # Draft up to N tokens a step from the request's own text (verified; see SamplingParams).
    prompt_lookup: int | None = None
    # Draft up to N tokens a step from suffix trees (own text, the tenant's earlier outputs).
    suffix_drafts: int | None = None
    # vLLM's structured-output fields (at most one; see server/structured.py).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


# -- OpenAI ----------------------------------------------------------------------------------


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCallBody(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None  # an assistant's past calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class OpenAITool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class OpenAISampling(ExtraSampling):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    response_format: ResponseFormat | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's: each prompt token's log-probability and its k most likely alternatives.
    prompt_logprobs: int | None = None


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage]
    # [{"title", "text"}], each one a chunk in the system message; `blend`: BlendParams' fields
    # (reuse the documents' K/V, APPROXIMATE; `blend/`).
    documents: list[dict[str, Any]] | None = None
    blend: dict[str, Any] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[OpenAITool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: extra variables for the chat template (Qwen3: {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None


class SegmentBody(_Body):
    text: str
    chunk: bool = False


class CompletionRequest(OpenAISampling):
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    segments: list[SegmentBody] | None = None  # instead of prompt: each tokenized alone
    blend: dict[str, Any] | None = None
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None


# -- Anthropic -------------------------------------------------------------------------------


class CacheControl(_Body):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class ContentBlock(_Body):
    """Any content block; text, tool_use, tool_result, document (a text source) and
    search_result are supported (the translation checks which fields each needs)."""

    type: str
    text: str | None = None
    cache_control: CacheControl | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None
    source: dict[str, Any] | str | None = None  # document: {"type": "text", "data": ...}
    title: str | None = None  # document, search_result


class AnthropicMessage(_Body):
    # system: Claude Code's mid-conversation system messages (server/anthropic_fields.py)
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(_Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: CacheControl | None = None


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    format: OutputFormat | None = None
    effort: str | None = None


class MessagesRequest(ExtraSampling):
    model: str
    max_tokens: int
    messages: list[AnthropicMessage]
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    output_config: OutputConfig | None = None
    n: int | None = None  # not an Anthropic field: refused with a clear message
    stop_sequences: list[str] | None = None
    cache_control: CacheControl | None = None  # a breakpoint on the last block
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    blend: dict[str, Any] | None = None  # document / search_result blocks become chunks
    # Checked (server/anthropic_fields.py); turns a thinking template's reasoning on or off.
    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
