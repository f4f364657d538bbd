"""The HTTP side of blending (APPROXIMATE chunk reuse, `blend/`): OpenAI chat `documents`,
`/v1/completions` `segments`, the `blend` settings object and `usage.blend`.

Documents and segments are tokenized the same way with or without `blend` (each chunk alone),
so a request without `blend` is an exact run of the very same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstack.blend.params import BlendParams, BlendSpec, Chunk
from kvstack.blend.segments import (
    chat_segments,
    document_text,
    tokenize_segments,
    with_documents,
)
from kvstack.outputs import RequestOutput
from kvstack.server.errors import ApiError
from kvstack.server.protocol import SegmentBody


def _spec(fields: dict[str, Any] | None, spans: Sequence[tuple[int, int]]) -> BlendSpec | None:
    return None if fields is None else BlendSpec(BlendParams.from_dict(fields), tuple(spans))


def chat_with_documents(tokenizer: Any, messages: list[dict[str, str]],
                        documents: list[dict[str, Any]], blend: dict[str, Any] | None
                        ) -> tuple[list[int], BlendSpec | None]:
    """Prompt ids of a chat whose system message lists the documents (one chunk each), and
    its blending."""
    marked, texts = with_documents(messages, documents)
    ids, spans = tokenize_segments(tokenizer, chat_segments(tokenizer, marked, texts))
    return ids, _spec(blend, spans)


def completion_segments(tokenizer: Any, segments: list[SegmentBody],
                        blend: dict[str, Any] | None) -> tuple[list[int], BlendSpec | None]:
    parts = [Chunk(s.text) if s.chunk else s.text for s in segments]
    ids, spans = tokenize_segments(tokenizer, parts)
    return ids, _spec(blend, spans)


def check_blend_input(has_chunks: bool, blend: dict[str, Any] | None, field: str) -> None:
    if blend is not None and not has_chunks:
        raise ApiError(400, f"blend needs chunks to reuse: give {field}", param="blend")


def document_block_text(block: Any, where: str) -> str:
    """The chunk text of an Anthropic `document` (text source) or `search_result` block."""
    if block.type == "document":
        source = block.source if isinstance(block.source, dict) else {}
        if source.get("type") != "text" or not isinstance(source.get("data"), str):
            raise ApiError(400, f"{where}: only documents with a text source are supported")
        text = source["data"]
    else:
        content = block.content
        parts = [content] if isinstance(content, str) else [
            b.text for b in content or [] if b.type == "text"]
        if not parts or not all(isinstance(p, str) for p in parts):
            raise ApiError(400, f"{where}: a search_result needs text content blocks")
        text = "\n".join(parts)
    return document_text({"title": block.title, "text": text}, where)


def segment_ids(tokenizer: Any, messages: list[dict[str, str]], chunks: list[str],
                final: bool, prefill: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """Prompt ids and chunk spans of messages whose contents hold `mark(i)` placeholders."""
    return tokenize_segments(tokenizer, chat_segments(
        tokenizer, messages, chunks, add_generation_prompt=final,
        continue_final_message=final and prefill))


def blend_usage(out: RequestOutput) -> dict[str, int] | None:
    """`usage.blend`, for a blended request that placed chunks."""
    b = out.blend
    if b is None:
        return None
    return {"chunks_hit": b.chunks_hit, "chunks_missed": b.chunks_missed,
            "reused_tokens": b.reused_tokens, "recomputed_tokens": b.recomputed_tokens}
