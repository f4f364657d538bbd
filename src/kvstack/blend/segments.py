"""Segmented prompts -> token ids and chunk spans; chats with documents -> segments.

Each segment is tokenized alone (no special tokens added) and the ids are concatenated, so a
chunk's ids never depend on its neighbours: the same document gives the same ids, hence the
same cache key, wherever it appears (a separator that merges into a neighbouring token cannot
make a chunk miss).

Documents in a chat are rendered with this template (documented in docs/cache/blending.md):
- each document is one chunk, `"Title: {title}\\n{text}"` (just `text` without a title);
  nothing position-dependent (an index, "[1]") goes inside a chunk, so a reordered document
  still hits;
- the chunks go at the end of the system message (one is added with `DOCUMENTS_SYSTEM` when
  the conversation has none), after `"\\n\\nDocuments:"`, separated by blank lines.
The conversation is rendered by the model's chat template with a placeholder where each chunk
goes, and the rendered text is split at the placeholders.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from kvstack.blend.params import BlendError, Chunk, Segment

DOCUMENTS_SYSTEM = "Answer the question using the documents below."
_MARK = "\ue000kvstack-chunk-{}\ue001"  # private-use characters: never in a real prompt


def tokenize_segments(tokenizer: Any, segments: Sequence[Segment]
                      ) -> tuple[list[int], list[tuple[int, int]]]:
    """(token ids, [start, end) span of each chunk) of a segment list: strings, lists of
    token ids (text already tokenized) and Chunks."""
    if isinstance(segments, (str, Chunk)) or not isinstance(segments, Sequence):
        raise BlendError("segments must be a list of strings, token id lists and Chunks")
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for i, segment in enumerate(segments):
        if isinstance(segment, Chunk):
            part = (list(segment.token_ids) if segment.token_ids is not None
                    else _encode(tokenizer, segment.text or ""))
            if not part:
                raise BlendError(f"segments[{i}] is an empty chunk; give it some text")
            spans.append((len(ids), len(ids) + len(part)))
        elif isinstance(segment, str):
            part = _encode(tokenizer, segment) if segment else []
        elif isinstance(segment, (list, tuple)) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in segment):
            part = list(segment)  # a text segment given as token ids
        else:
            raise BlendError(f"segments[{i}] is a {type(segment).__name__}; give a string, "
                             "a list of token ids or a Chunk")
        ids.extend(part)
    if not ids:
        raise BlendError("the segment list has no text; give at least one non-empty segment")
    return ids, spans


def _encode(tokenizer: Any, text: str) -> list[int]:
    if tokenizer is None:
        raise BlendError("this engine runs without a tokenizer; give chunks as token_ids and "
                         "no text segments")
    return list(tokenizer.encode(text, add_special_tokens=False))


def document_text(document: Mapping[str, Any], where: str = "documents") -> str:
    """One document's chunk text (the template above)."""
    if not isinstance(document, Mapping) or not isinstance(document.get("text"), str):
        raise BlendError(f"{where}: a document is an object with a 'text' string")
    title = document.get("title")
    if title is not None and not isinstance(title, str):
        raise BlendError(f"{where}: a document's 'title' must be a string")
    text = document["text"]
    if not text.strip():
        raise BlendError(f"{where}: a document's text is empty; give it some text")
    return f"Title: {title}\n{text}" if title else text


def mark(index: int) -> str:
    """The placeholder of chunk `index` inside a message's content."""
    return _MARK.format(index)


def with_documents(messages: Sequence[Mapping[str, Any]],
                   documents: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]],
                                                                    list[str]]:
    """Messages with each document's placeholder at the end of the system message, and the
    documents' chunk texts."""
    texts = [document_text(d, f"documents[{i}]") for i, d in enumerate(documents)]
    listing = "\n\nDocuments:\n\n" + "\n\n".join(mark(i) for i in range(len(texts)))
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}{listing}"
    else:
        out.insert(0, {"role": "system", "content": DOCUMENTS_SYSTEM + listing})
    return out, texts


def chat_segments(tokenizer: Any, messages: Sequence[Mapping[str, Any]], chunks: Sequence[str],
                  add_generation_prompt: bool = True, continue_final_message: bool = False
                  ) -> list[Segment]:
    """Render a conversation whose contents hold `mark(i)` placeholders with the chat template
    and split it into text segments and `Chunk(chunks[i])`."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise BlendError("this model has no chat template; send segments instead of messages")
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message)
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as err:
        raise BlendError(f"the chat template cannot render these messages: {err}") from err
    segments: list[Segment] = []
    for i, chunk in enumerate(chunks):
        head, found, text = text.partition(mark(i))
        if not found or "\ue000" in head or mark(i) in text:
            raise BlendError("the chat template does not keep documents verbatim; send "
                             "segments instead")
        if head:
            segments.append(head)
        segments.append(Chunk(chunk))
    if text:
        segments.append(text)
    return segments
